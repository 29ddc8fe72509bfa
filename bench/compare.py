#!/usr/bin/env python3
"""Prints Kiln's and a baseline's `bench` JSON side by side, with ratios, and writes both into
one JSON file.  Usage: compare.py KILN.json BASELINE.json OUT.json"""
import json
import sys


def rows(doc, who):
    for mode, m in doc.get("modes", {}).items():
        for metric, v in m.items():
            yield (f"{who} {mode}", metric, v)


def main():
    kiln = json.load(open(sys.argv[1]))
    base = json.load(open(sys.argv[2]))
    out = {"kiln": kiln, "baseline": base}
    print(f"{kiln['model']} on {kiln['device']}, batch {kiln['batch']}, 3x{kiln['size']}x{kiln['size']}, "
          f"{kiln['threads']} threads")
    if "error" in base:
        print(f"(no baseline: {base['error']})")
    metrics = ["inference_ms", "train_step_ms"]
    print(f"{'':34} {'inference ms':>14} {'train step ms':>14}")
    for who, doc in (("kiln", kiln), (base.get("framework", "baseline"), base)):
        for mode, m in doc.get("modes", {}).items():
            cells = [f"{m[k]:14.1f}" if k in m else f"{'-':>14}" for k in metrics]
            print(f"{who + ' ' + mode:34} {' '.join(cells)}")
    ratios = {}
    k_eager = kiln.get("modes", {}).get("eager", {})
    for mode, m in base.get("modes", {}).items():
        for metric in metrics:
            if metric in m and metric in k_eager:
                ratios[f"{mode}/{metric}"] = m[metric] / k_eager[metric]
    if ratios:
        print("speedup of kiln eager over the baseline (baseline time / kiln time):")
        for k, v in ratios.items():
            print(f"  {k:40} {v:6.2f}x")
    out["speedup_vs_baseline"] = ratios
    json.dump(out, open(sys.argv[3], "w"), indent=2)


if __name__ == "__main__":
    main()
