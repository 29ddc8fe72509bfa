#!/usr/bin/env python3
"""PyTorch DistributedDataParallel on the same work as `kiln bench ddp`, for a side-by-side run.

Run under torchrun, one process per GPU (or two on the CPU):
    torchrun --nproc_per_node 2 torch_ddp_baseline.py densenet121 --device cuda --batch 16 --size 128

Each rank trains a torchvision model on its own batch (--batch per rank) with Adam (lr 1e-3) and
cross-entropy, as `kiln bench ddp` does. Per mode (--modes eager,compile):
  single:  rank 0 alone, the same step without DDP (the other ranks wait): ms per step
  ddp:     every rank, DDP (25 MB buckets): ms per step (the slowest rank's)
timed in --rounds alternating rounds of --iters steps (medians).
  scaling efficiency = single ms / ddp ms (= ddp samples/s / (world x single samples/s))
`compile` is torch.compile(model) inside DDP (Dynamo's DDPOptimizer splits the graph at bucket
boundaries). Rank 0 prints one JSON object; exits 3 when torch or torchvision is missing.
"""
import argparse
import json
import os
import statistics
import sys
import time

try:
    import torch
    import torch.distributed as dist
    import torchvision
except ImportError as e:
    print(json.dumps({"error": f"baseline unavailable: {e}"}))
    sys.exit(3)


def time_steps(step, warmup, iters):
    for _ in range(warmup):
        step().item()
    t0 = time.perf_counter()
    for _ in range(iters):
        step().item()
    return (time.perf_counter() - t0) * 1000.0 / iters


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--modes", default="eager,compile")
    a = p.parse_args()

    cuda = a.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    torch.manual_seed(100 + rank)
    x = torch.randn(a.batch, 3, a.size, a.size, device=dev)
    y = torch.randint(0, a.classes, (a.batch,), device=dev)
    result = {"bench": "ddp", "model": a.model, "device": a.device, "world_size": world,
              "batch_per_rank": a.batch, "size": a.size, "iters": a.iters, "warmup": a.warmup, "rounds": a.rounds,
              "torch": torch.__version__, "backend": "nccl" if cuda else "gloo", "modes": {}}
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(dev)

    def build(mode, ddp):
        torch.manual_seed(0)
        model = getattr(torchvision.models, a.model)(num_classes=a.classes).to(dev)
        run = model
        if ddp:
            run = torch.nn.parallel.DistributedDataParallel(run, device_ids=[local_rank] if cuda else None)
        if mode == "compile":
            run = torch.compile(run)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(run(x), y)
            loss.backward()
            opt.step()
            return loss
        return step

    for mode in a.modes.split(","):
        m = {}
        single = None
        if rank == 0:
            single = build(mode, False)
            t0 = time.perf_counter()
            single().item()
            m["single_first_step_s"] = time.perf_counter() - t0
        ddp = build(mode, True)
        t0 = time.perf_counter()
        ddp().item()
        m["ddp_first_step_s"] = time.perf_counter() - t0
        single_ms, ddp_ms = [], []
        for r in range(a.rounds):  # alternating rounds, medians (as kiln bench ddp)
            warm = a.warmup if r == 0 else 1
            if rank == 0:
                single_ms.append(time_steps(single, warm, a.iters))
            dist.barrier()
            ms = torch.tensor([time_steps(ddp, warm, a.iters)], dtype=torch.float64, device=dev)
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            ddp_ms.append(ms.item())
            dist.barrier()
        if rank == 0:
            m["single_step_ms"] = statistics.median(single_ms)
            m["ddp_step_ms"] = statistics.median(ddp_ms)
            m["single_step_ms_rounds"] = single_ms
            m["ddp_step_ms_rounds"] = ddp_ms
            m["single_samples_per_s"] = a.batch * 1000.0 / m["single_step_ms"]
            m["ddp_samples_per_s"] = world * a.batch * 1000.0 / m["ddp_step_ms"]
            m["ddp_samples_per_s_per_rank"] = a.batch * 1000.0 / m["ddp_step_ms"]
            m["scaling_efficiency"] = m["single_step_ms"] / m["ddp_step_ms"]
            result["modes"][mode] = m
        dist.barrier()
    if rank == 0:
        print(json.dumps(result, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
