#!/usr/bin/env python3
"""Times PyTorch on the same work as `kiln bench MODEL`, for a side-by-side comparison.

A model (densenet121, resnet18, ...): inference (eval, no_grad) in each of --modes and the
whole Adam step, optimizer included, in each of --train-modes. The modes: eager, torchscript
(TorchScript-frozen; CPU inference only), and torch.compile's default, reduce-overhead and
max-autotune (Inductor: C++ on a CPU, Triton on a GPU; compiling takes minutes). Per mode: the
median time (CUDA events on a GPU), the compile time (the first three calls) and, on a GPU, the
peak memory (torch.cuda.max_memory_allocated over that mode's runs). A torch.compile mode on a
PyTorch without it (< 2.0) is reported with an "unavailable" reason instead of a time.
Usage: torch_baseline.py densenet121 --device cpu|cuda --batch 16 --size 128 [--train] [--threads N]
       [--modes eager,torchscript,default] [--train-modes eager,default]
(defaults: CPU eager,torchscript,default; GPU eager,default,reduce-overhead; steps eager,default)

`toy` is the counterpart of `kiln bench toy`: microseconds per call of the set_stance recipe's
three 5x5 matmuls in eager mode and, where torch.compile exists (PyTorch >= 2.0), compiled with
the default mode and with mode="reduce-overhead"; a mode that cannot run is reported with an
"unavailable" reason instead of a time.
Usage: torch_baseline.py toy [--iters 2000] [--batches 7] [--warmup 3] [--threads N]

Prints one JSON object; exits 3 when torch (or, for a model, torchvision) is not installed.
"""
import argparse
import json
import statistics
import sys
import time

from machine_info import cpu_name

try:
    import torch
except ImportError as e:  # the baseline is optional
    print(json.dumps({"error": f"baseline unavailable: {e}"}))
    sys.exit(3)


def median_ms(fn, warmup, iters, sync):
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cuda_median_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def profile_once(fn):
    """--profile: one more call with the CUDA profilers collecting (ncu --profile-from-start off)."""
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


# The modes a model can run in: eager, TorchScript-frozen (CPU inference only) and torch.compile's.
MODE_NAMES = {"eager": "eager", "torchscript": "torchscript_frozen", "default": "torch_compile",
              "reduce-overhead": "torch_compile_reduce_overhead", "max-autotune": "torch_compile_max_autotune"}
COMPILE_KWARGS = {"default": {}, "reduce-overhead": {"mode": "reduce-overhead"},
                  "max-autotune": {"mode": "max-autotune"}}


def parse_modes(text, allowed, what):
    modes = [m for m in text.split(",") if m]
    for m in modes:
        if m not in allowed:
            sys.exit(f"torch_baseline.py: {what} '{m}' is not one of {', '.join(allowed)}")
    return modes


def compile_unavailable():
    """Why torch.compile cannot run here, or None."""
    if not hasattr(torch, "compile"):
        return f"torch.compile needs PyTorch >= 2.0; this is {torch.__version__}"
    return None


def model_modes(a, model, x, y):
    """Inference and the Adam step in each mode, side by side: per mode the median time, the
    compile time (the first three calls) and, on a GPU, the peak memory."""
    import copy
    cuda = x.is_cuda
    out = {"framework": f"torch {torch.__version__}", "model": a.model, "device": x.device.type,
           "batch": a.batch, "size": a.size, "threads": torch.get_num_threads(), "modes": {}}
    if cuda:
        out["gpu"] = torch.cuda.get_device_name()
        time_ms = lambda fn: cuda_median_ms(fn, a.warmup, a.iters)  # noqa: E731
        sync = torch.cuda.synchronize
    else:
        out["cpu"] = cpu_name()
        time_ms = lambda fn: median_ms(fn, a.warmup, a.iters, lambda: None)  # noqa: E731
        sync = lambda: None  # noqa: E731
    infer_allowed = ["eager", "default", "reduce-overhead", "max-autotune"] + ([] if cuda else ["torchscript"])
    train_allowed = ["eager", "default", "reduce-overhead", "max-autotune"]

    def build(mode, fn):
        """fn in `mode`, or the reason it cannot run."""
        if mode == "eager":
            return fn, None
        why = compile_unavailable()
        return (None, why) if why else (torch.compile(fn, **COMPILE_KWARGS[mode]), None)

    for mode in parse_modes(a.modes, infer_allowed, "inference mode"):
        model.eval()
        r = out["modes"].setdefault(MODE_NAMES[mode], {})
        with torch.no_grad():
            if mode == "torchscript":
                fn, why = torch.jit.freeze(torch.jit.script(model)), None
            else:
                fn, why = build(mode, model)
            if why:
                r["unavailable"] = why
                continue
            sync()
            t0 = time.perf_counter()
            for _ in range(3):  # reduce-overhead records its CUDA graph on a later call
                fn(x)
            sync()
            if mode not in ("eager", "torchscript"):
                r["inference_compile_s"] = time.perf_counter() - t0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            r["inference_ms"] = time_ms(lambda: fn(x))
            if cuda:
                r["inference_peak_bytes"] = torch.cuda.max_memory_allocated()
                if a.profile == "infer":
                    profile_once(lambda: fn(x))
    if a.train:
        for mode in parse_modes(a.train_modes, train_allowed, "training mode"):
            m = copy.deepcopy(model).train()
            opt = torch.optim.Adam(m.parameters(), lr=1e-3)

            def step():
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(m(x), y)
                loss.backward()
                opt.step()
                return loss

            r = out["modes"].setdefault(MODE_NAMES[mode], {})
            fn, why = build(mode, step)
            if why:
                r["unavailable"] = why
                continue
            sync()
            t0 = time.perf_counter()
            for _ in range(3):
                fn()
            sync()
            if mode != "eager":
                r["train_compile_s"] = time.perf_counter() - t0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            r["train_step_ms"] = time_ms(fn)
            if cuda:
                r["train_peak_bytes"] = torch.cuda.max_memory_allocated()
                if a.profile == "train":
                    profile_once(fn)
    return out


def toy_model(x, y):
    x = x @ y
    x = x @ y
    x = x @ y
    return x


def time_batch_us(fn, x, y, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x, y)
    if x.is_cuda:  # the calls queue GPU work; a call's cost includes finishing it
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / iters


def toy(a):
    """Per-call time of toy_model: eager, torch.compile default, torch.compile reduce-overhead."""
    torch.manual_seed(0)
    dev = torch.device(a.device)
    x, y = torch.randn(5, 5, device=dev), torch.randn(5, 5, device=dev)
    expected = toy_model(x, y)
    fns = {"eager": toy_model}
    unavailable = {}
    for mode, kwargs in (("torch_compile", {}), ("torch_compile_reduce_overhead", {"mode": "reduce-overhead"})):
        if not hasattr(torch, "compile"):
            unavailable[mode] = f"torch.compile needs PyTorch >= 2.0; this is {torch.__version__}"
            continue
        try:
            fn = torch.compile(toy_model, **kwargs)
            # The first calls compile; each compiled mode must equal eager.
            for _ in range(max(a.warmup, 3)):
                if not torch.allclose(fn(x, y), expected, rtol=1.3e-6, atol=1e-5):
                    raise RuntimeError("result differs from eager")
            fns[mode] = fn
        except Exception as e:  # no C++ compiler, Triton, ...: report why instead of a time
            unavailable[mode] = f"{type(e).__name__}: {e}".splitlines()[0]
    for _ in range(a.warmup):
        toy_model(x, y)
    # Batches of the modes alternate, as in `kiln bench toy`, so machine load hits each alike.
    # Grad mode stays on, as in Kiln's bench (no input requires grad, so nothing is recorded).
    times = {mode: [] for mode in fns}
    for _ in range(a.batches):
        for mode, fn in fns.items():
            times[mode].append(time_batch_us(fn, x, y, a.iters))
    out = {"framework": f"torch {torch.__version__}", "model": "toy",
           "function": "x = x @ y three times, x and y randn 5x5 float32", "device": a.device,
           "threads": torch.get_num_threads(), "warmup": a.warmup, "iters": a.iters, "batches": a.batches,
           "modes": {}}
    eager_us = statistics.median(times["eager"])
    for mode in ("eager", "torch_compile", "torch_compile_reduce_overhead"):
        if mode in unavailable:
            out["modes"][mode] = {"unavailable": unavailable[mode]}
            continue
        us = statistics.median(times[mode])
        out["modes"][mode] = {"us_per_call": us} if mode == "eager" else {"us_per_call": us, "overhead_us": us - eager_us}
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model", help="a torchvision model (densenet121, ...) or toy")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--train", action="store_true")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--warmup", type=int, default=None, help="default 2 (toy: 3)")
    p.add_argument("--iters", type=int, default=None, help="timed runs, default 5 (toy: calls per batch, 2000)")
    p.add_argument("--batches", type=int, default=7, help="toy only: the time is the median batch")
    p.add_argument("--modes", default=None,
                   help="inference modes among eager, torchscript (CPU), default, reduce-overhead, max-autotune; "
                        "default eager,torchscript,default on a CPU, eager,default,reduce-overhead on a GPU")
    p.add_argument("--train-modes", default=None, help="training-step modes (--train), default eager,default")
    p.add_argument("--profile", choices=["infer", "train"],
                   help="cuda only: one more such call per mode inside torch.cuda.profiler.start/stop, for ncu")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.model == "toy":
        a.warmup = 3 if a.warmup is None else a.warmup
        a.iters = 2000 if a.iters is None else a.iters
        print(json.dumps(toy(a), indent=2))
        return
    a.warmup = (2 if a.device == "cpu" else 5) if a.warmup is None else a.warmup
    a.iters = (5 if a.device == "cpu" else 50) if a.iters is None else a.iters
    try:
        import torchvision
    except ImportError as e:  # the baseline is optional
        print(json.dumps({"error": f"baseline unavailable: {e}"}))
        sys.exit(3)
    dev = torch.device(a.device)
    if a.modes is None:
        a.modes = "eager,default,reduce-overhead" if dev.type == "cuda" else "eager,torchscript,default"
    if a.train_modes is None:
        a.train_modes = "eager,default"
    torch.manual_seed(0)
    model = getattr(torchvision.models, a.model)(num_classes=a.classes).to(dev)
    x = torch.randn(a.batch, 3, a.size, a.size, device=dev)
    y = torch.randint(0, a.classes, (a.batch,), device=dev)
    print(json.dumps(model_modes(a, model, x, y), indent=2))

if __name__ == "__main__":
    main()
