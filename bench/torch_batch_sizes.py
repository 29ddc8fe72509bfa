#!/usr/bin/env python3
"""PyTorch's side of `kiln bench batch-sizes`: one model at every batch size, eager vs torch.compile.

A torchvision model (densenet121 by default, eval mode, no_grad) on random --size x --size images
at every batch size from --min-batch to --max-batch. Modes, as Kiln's bench names them:
  eager; dynamic = torch.compile(dynamic=None) (automatic dynamic); dynamic-ro = the same with
  mode="reduce-overhead" (CUDA graphs per size); static-ro = dynamic=False, reduce-overhead.
Each mode makes a cold pass (every size once: compiles included) and a warm pass (per size one
more call, then --iters timed calls; the mean over sizes of ms per call). Unique graphs come
from torch._dynamo's counters; the cold pass's seconds include every compile.
Usage: torch_batch_sizes.py --device cuda [--model densenet121] [--min-batch 1] [--max-batch 32]
       [--size 128] [--iters 5] [--modes eager,dynamic,dynamic-ro]
Prints one JSON object; exits 3 when torch or torchvision is not installed.
"""
import argparse
import json
import sys
import time

try:
    import torch
    import torchvision
except ImportError as e:
    print(json.dumps({"error": f"baseline unavailable: {e}"}))
    sys.exit(3)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="densenet121")
    p.add_argument("--min-batch", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--modes", default="eager,dynamic,dynamic-ro")
    a = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device(a.device)
    model = getattr(torchvision.models, a.model)().to(dev).eval()
    images = [torch.randn(b, 3, a.size, a.size, device=dev) for b in range(a.min_batch, a.max_batch + 1)]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    result = {"model": a.model, "device": a.device, "torch": torch.__version__, "min_batch": a.min_batch,
              "max_batch": a.max_batch, "size": a.size, "iters": a.iters, "modes": {}}
    eager_warm = None
    with torch.no_grad():
        for mode in a.modes.split(","):
            torch._dynamo.reset()
            from torch._dynamo.utils import counters
            counters.clear()
            kwargs = {"mode": "reduce-overhead"} if mode.endswith("-ro") else {}
            if mode == "eager":
                fwd = model
            elif mode == "static-ro":
                fwd = torch.compile(model, dynamic=False, **kwargs)
            else:
                fwd = torch.compile(model, dynamic=None, **kwargs)
            sync()
            t0 = time.perf_counter()
            for x in images:
                fwd(x)
            sync()
            cold = time.perf_counter() - t0
            per_size = []
            for x in images:
                fwd(x)
                sync()
                w0 = time.perf_counter()
                for _ in range(a.iters):
                    fwd(x)
                sync()
                per_size.append((time.perf_counter() - w0) * 1e3 / a.iters)
            warm = sum(per_size) / len(per_size)
            if mode == "eager":
                eager_warm = warm
            m = {"cold_seconds": cold, "warm_ms_per_call": warm, "warm_ms_by_batch": per_size,
                 "unique_graphs": counters["stats"].get("unique_graphs", 0)}
            if eager_warm:
                m["warm_speedup_vs_eager"] = eager_warm / warm
            result["modes"][mode] = m
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
