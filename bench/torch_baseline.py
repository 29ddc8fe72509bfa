#!/usr/bin/env python3
"""Times PyTorch on the same work as `kiln bench MODEL`, for a side-by-side comparison.

CPU: eager inference (eval, no_grad), TorchScript-frozen inference and an Adam training step.
Usage: torch_baseline.py densenet121 --device cpu --batch 16 --size 128 [--train] [--threads N]
Prints one JSON object; exits 3 when torch or torchvision is not installed.
"""
import argparse
import json
import statistics
import sys
import time

try:
    import torch
    import torchvision
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--train", action="store_true")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = getattr(torchvision.models, a.model)(num_classes=a.classes).to(dev)
    x = torch.randn(a.batch, 3, a.size, a.size, device=dev)
    y = torch.randint(0, a.classes, (a.batch,), device=dev)
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
