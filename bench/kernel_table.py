#!/usr/bin/env python3
"""Sums the GPU time of each kernel in an Nsight Compute CSV, biggest first.

    ncu --profile-from-start off --graph-profiling node --clock-control none \\
        --metrics gpu__time_duration.sum --csv --log-file kiln.csv \\
        kiln bench densenet121 --device cuda --modes kiln-ro --profile infer
    python3 bench/kernel_table.py kiln.csv [--top 40] [--width 90]

`kiln bench --profile` and `bench/torch_baseline.py --profile` run one more call per mode inside
the profiler's start/stop, so the table is one call's kernels (profile one mode per run).
"""
import argparse
import collections
import csv
import sys


def rows(path):
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # skip ncu's own log lines
    return csv.DictReader(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--width", type=int, default=90)
    a = p.parse_args()
    total_ns = collections.Counter()
    count = collections.Counter()
    for r in rows(a.csv):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(r["Metric Value"].replace(",", ""))
        scale = {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "s": 1e9, "second": 1e9}[r["Metric Unit"]]
        name = r["Kernel Name"]
        total_ns[name] += value * scale
        count[name] += 1
    if not total_ns:
        sys.exit(f"{a.csv}: no gpu__time_duration.sum rows")
    all_ns = sum(total_ns.values())
    print(f"{sum(count.values())} kernels, {all_ns / 1e3:.1f} us of GPU time")
    print(f"{'us':>9} {'%':>5} {'calls':>6}  kernel")
    for name, ns in total_ns.most_common(a.top):
        print(f"{ns / 1e3:9.1f} {100 * ns / all_ns:5.1f} {count[name]:6d}  {name[:a.width]}")


if __name__ == "__main__":
    main()
