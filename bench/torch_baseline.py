#!/usr/bin/env python3
"""Times PyTorch on the same work as `kiln bench MODEL`, for a side-by-side comparison.

CPU: eager inference (eval, no_grad), TorchScript-frozen inference and an Adam training step.
Usage: torch_baseline.py densenet121 --device cpu --batch 16 --size 128 [--train] [--threads N]

CUDA: eager, torch.compile (default) and torch.compile(mode="reduce-overhead") for inference
(--modes) and for the whole Adam step, optimizer included (--train-modes; compiling the step
takes minutes); per mode the median time (CUDA events), the compile time (the first calls) and
the peak memory (torch.cuda.max_memory_allocated over that mode's runs).
Usage: torch_baseline.py densenet121 --device cuda --batch 16 --size 128 [--train]
       [--modes eager,default,reduce-overhead] [--train-modes eager,default]

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


def cuda_model(a, model, x, y):
    """Inference and the Adam step on a GPU: eager and torch.compile modes, side by side."""
    import copy
    out = {"framework": f"torch {torch.__version__}", "model": a.model, "device": "cuda",
           "gpu": torch.cuda.get_device_name(), "batch": a.batch, "size": a.size, "modes": {}}
    compile_kwargs = {"eager": None, "default": {}, "reduce-overhead": {"mode": "reduce-overhead"}}
    name = {"eager": "eager", "default": "torch_compile", "reduce-overhead": "torch_compile_reduce_overhead"}
    for mode in a.modes.split(","):
        model.eval()
        fn = model if mode == "eager" else torch.compile(model, **compile_kwargs[mode])
        r = out["modes"].setdefault(name[mode], {})
        with torch.no_grad():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(3):  # reduce-overhead records its CUDA graph on a later call
                fn(x)
            torch.cuda.synchronize()
            if mode != "eager":
                r["inference_compile_s"] = time.perf_counter() - t0
            torch.cuda.reset_peak_memory_stats()
            r["inference_ms"] = cuda_median_ms(lambda: fn(x), a.warmup, a.iters)
            r["inference_peak_bytes"] = torch.cuda.max_memory_allocated()
            if a.profile == "infer":
                profile_once(lambda: fn(x))
    if a.train:
        for mode in a.train_modes.split(","):
            m = copy.deepcopy(model).train()
            opt = torch.optim.Adam(m.parameters(), lr=1e-3)

            def step():
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(m(x), y)
                loss.backward()
                opt.step()
                return loss

            fn = step if mode == "eager" else torch.compile(step, **compile_kwargs[mode])
            r = out["modes"].setdefault(name[mode], {})
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            if mode != "eager":
                r["train_compile_s"] = time.perf_counter() - t0
            torch.cuda.reset_peak_memory_stats()
            r["train_step_ms"] = cuda_median_ms(fn, a.warmup, a.iters)
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
    p.add_argument("--modes", default="eager,default,reduce-overhead", help="cuda only: inference modes")
    p.add_argument("--train-modes", default="eager,default", help="cuda only: training-step modes")
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
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = getattr(torchvision.models, a.model)(num_classes=a.classes).to(dev)
    x = torch.randn(a.batch, 3, a.size, a.size, device=dev)
    y = torch.randint(0, a.classes, (a.batch,), device=dev)
    if dev.type == "cuda":
        print(json.dumps(cuda_model(a, model, x, y), indent=2))
        return
    out = {"framework": f"torch {torch.__version__}", "model": a.model, "device": str(dev),
           "batch": a.batch, "size": a.size, "threads": torch.get_num_threads(), "modes": {}}

    model.eval()
    with torch.no_grad():
        eager = {"inference_ms": median_ms(lambda: model(x), a.warmup, a.iters, sync)}
        frozen = torch.jit.freeze(torch.jit.script(model))
        script = {"inference_ms": median_ms(lambda: frozen(x), a.warmup, a.iters, sync)}
    if a.train:
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()

        eager["train_step_ms"] = median_ms(step, a.warmup, a.iters, sync)
    out["modes"]["eager"] = eager
    out["modes"]["torchscript_frozen"] = script
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
