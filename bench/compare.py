#!/usr/bin/env python3
"""Prints Kiln's and a baseline's `bench` JSON side by side, with ratios, and writes both into
one JSON file.  Usage: compare.py KILN.json BASELINE.json OUT.json

Model benchmarks (`kiln bench densenet121`) compare milliseconds per inference and training step;
`kiln bench toy` against `torch_baseline.py toy` compares microseconds per call of a tiny function
(the per-call overhead of eager dispatch and of compile())."""
import json
import sys


def rows(doc, who):
    for mode, m in doc.get("modes", {}).items():
        for metric, v in m.items():
            yield (f"{who} {mode}", metric, v)


def compare_models(kiln, base):
    print(f"{kiln['model']} on {kiln['device']}, batch {kiln['batch']}, 3x{kiln['size']}x{kiln['size']}, "
          f"{kiln['threads']} threads")
    if "error" in base:
        print(f"(no baseline: {base['error']})")
    metrics = ["inference_ms", "train_step_ms"]
    print(f"{'':34} {'inference ms':>14} {'train step ms':>14} {'compile cold s':>15} {'compile warm s':>15}")
    for who, doc in (("kiln", kiln), (base.get("framework", "baseline"), base)):
        for mode, m in doc.get("modes", {}).items():
            cells = [f"{m[k]:14.1f}" if k in m else f"{'-':>14}" for k in metrics]
            cells += [f"{m[k]:15.2f}" if k in m else f"{'-':>15}"
                      for k in ("inference_compile_cold_s", "inference_compile_warm_s")]
            print(f"{who + ' ' + mode:34} {' '.join(cells)}")
    # Every Kiln mode (eager, and compiled modes such as kiln) against every baseline mode.
    ratios = {}
    for k_mode, km in kiln.get("modes", {}).items():
        for mode, m in base.get("modes", {}).items():
            for metric in metrics:
                if metric in m and metric in km:
                    ratios[f"{mode}/kiln {k_mode}/{metric}"] = m[metric] / km[metric]
        if k_mode != "eager":
            ke = kiln.get("modes", {}).get("eager", {})
            for metric in metrics:
                if metric in km and metric in ke:
                    ratios[f"kiln eager/kiln {k_mode}/{metric}"] = ke[metric] / km[metric]
    if ratios:
        print("speedups (first time / second time):")
        for k, v in ratios.items():
            print(f"  {k:48} {v:6.2f}x")
    return ratios


# Which Kiln modes each baseline mode is set against in the toy comparison: eager with eager,
# a compiled mode with both of Kiln's (torch.compile skips the Python body like a pure replay).
TOY_PAIRS = {"eager": ["eager"],
             "torch_compile": ["compiled", "compiled_pure"],
             "torch_compile_reduce_overhead": ["compiled", "compiled_pure"]}


def compare_toy(kiln, base):
    print(f"toy ({kiln.get('function', 'x = x @ y three times, 5x5')}) on {kiln['device']}, "
          f"kiln backend '{kiln.get('backend', '?')}', kiln {kiln['threads']} threads, "
          f"baseline {base.get('threads', '?')} threads")
    if "error" in base:
        print(f"(no baseline: {base['error']})")
    print(f"{'':44} {'us per call':>12} {'overhead us':>12}")
    for who, doc in (("kiln", kiln), (base.get("framework", "baseline"), base)):
        for mode, m in doc.get("modes", {}).items():
            label = f"{who} {mode}"
            if "us_per_call" not in m:
                print(f"{label:44} {'unavailable':>12}  ({m.get('unavailable', 'no time')})")
                continue
            overhead = f"{m['overhead_us']:+12.2f}" if "overhead_us" in m else f"{'-':>12}"
            print(f"{label:44} {m['us_per_call']:12.2f} {overhead}")
    ratios = {}
    k_modes = kiln.get("modes", {})
    for mode, m in base.get("modes", {}).items():
        for k_mode in TOY_PAIRS.get(mode, []):
            if "us_per_call" in m and "us_per_call" in k_modes.get(k_mode, {}):
                ratios[f"{mode}/kiln {k_mode}"] = m["us_per_call"] / k_modes[k_mode]["us_per_call"]
    if ratios:
        print("speedup of kiln over the baseline (baseline time / kiln time):")
        for k, v in ratios.items():
            print(f"  {k:44} {v:6.2f}x")
    return ratios


def main():
    kiln = json.load(open(sys.argv[1]))
    base = json.load(open(sys.argv[2]))
    out = {"kiln": kiln, "baseline": base}
    if kiln.get("model") == "toy":
        out["speedup_vs_baseline"] = compare_toy(kiln, base)
    else:
        out["speedup_vs_baseline"] = compare_models(kiln, base)
    json.dump(out, open(sys.argv[3], "w"), indent=2)


if __name__ == "__main__":
    main()
