#!/usr/bin/env python3
"""Joins `kiln bench MODEL --device cpu --json` runs at several thread counts, and PyTorch's
(`torch_baseline.py --device cpu`) at some of them, into one JSON file and prints two tables:
Kiln's modes by thread count, and Kiln beside PyTorch where both ran (ratios are PyTorch's time
over Kiln's: above 1.0, Kiln is faster).

Usage: cpu_threads.py OUT.json KILN_T1.json [KILN_T2.json ...] [--torch TORCH_T.json ...]
Each input records its own thread count; a file that is missing or holds no JSON object is
reported and left out (a run that failed), so that the others are still joined."""
import json
import sys
import time

from machine_info import cpu_name


def load(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        print(f"cpu_threads.py: left out {path}: {e}", file=sys.stderr)
        return None
    if not isinstance(doc, dict) or "modes" not in doc:
        print(f"cpu_threads.py: left out {path}: no benchmark result ({str(doc)[:200]})", file=sys.stderr)
        return None
    return doc


def cell(m, key, width=9, digits=1):
    v = m.get(key) if m else None
    return f"{v:{width}.{digits}f}" if isinstance(v, (int, float)) else f"{'-':>{width}}"


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    out_path, rest = argv[0], argv[1:]
    kiln_paths, torch_paths, into = [], [], None
    for arg in rest:
        if arg == "--torch":
            into = torch_paths
            continue
        (kiln_paths if into is None else into).append(arg)
    kiln = {d["threads"]: d for d in map(load, kiln_paths) if d}
    torch = {d["threads"]: d for d in map(load, torch_paths) if d}
    if not kiln:
        sys.exit("cpu_threads.py: no Kiln result to join")
    first = next(iter(kiln.values()))
    joined = {"model": first["model"], "batch": first["batch"], "size": first["size"], "cpu": cpu_name(),
              "date": time.strftime("%Y-%m-%d"),
              "kiln": {str(t): kiln[t] for t in sorted(kiln)}, "torch": {str(t): torch[t] for t in sorted(torch)}}

    modes = [m for m in ("eager", "kiln", "kiln-at", "kiln-ro", "kiln-module") if any(m in d["modes"] for d in kiln.values())]
    print(f"{joined['model']}, batch {joined['batch']}, 3x{joined['size']}x{joined['size']}, float32, on {joined['cpu']}")
    print("Kiln, ms (inference | training step); compiled modes also as speedup over eager")
    header = f"{'threads':>7} " + " ".join(f"{m + ' inf':>14}" for m in modes) + "  " + \
        " ".join(f"{m + ' step':>14}" for m in modes)
    print(header)
    ratios = {}
    for t in sorted(kiln):
        ms = kiln[t]["modes"]
        row = [f"{t:>7}"]
        for metric in ("inference_ms", "train_step_ms"):
            eager = ms.get("eager", {}).get(metric)
            for m in modes:
                v = ms.get(m, {}).get(metric)
                if v is None:
                    row.append(f"{'-':>14}")
                elif m == "eager" or not eager:
                    row.append(f"{v:>14.1f}")
                else:
                    row.append(f"{v:>7.1f} {eager / v:>5.2f}x")
                    ratios[f"{t} threads/kiln eager/kiln {m}/{metric}"] = eager / v
            row.append("")
        print(" ".join(row))

    # Kiln beside PyTorch at the thread counts both ran.
    for t in sorted(set(kiln) & set(torch)):
        ms, tms = kiln[t]["modes"], torch[t]["modes"]
        print(f"\n{t} threads: PyTorch ({torch[t].get('framework', 'torch')}) beside Kiln")
        print(f"{'':36} {'inference ms':>12} {'step ms':>9} {'compile s (inf / step)':>24}")
        for who, doc in (("kiln", ms), ("torch", tms)):
            for mode, m in doc.items():
                if "unavailable" in m:
                    print(f"{who + ' ' + mode:36} unavailable: {m['unavailable']}")
                    continue
                inf_c = m.get("inference_compile_cold_s", m.get("inference_compile_s"))
                step_c = m.get("train_compile_cold_s", m.get("train_compile_s"))
                comp = f"{inf_c:.1f} / {step_c:.1f}" if inf_c is not None and step_c is not None else \
                    (f"{inf_c:.1f} / -" if inf_c is not None else "")
                print(f"{who + ' ' + mode:36} {cell(m, 'inference_ms', 12)} {cell(m, 'train_step_ms', 9)} {comp:>24}")
        for tmode, tm in tms.items():
            for kmode, km in ms.items():
                for metric in ("inference_ms", "train_step_ms"):
                    if metric in tm and metric in km:
                        ratios[f"{t} threads/torch {tmode}/kiln {kmode}/{metric}"] = tm[metric] / km[metric]
        print("torch time / Kiln time (above 1.0: Kiln is faster):")
        for k, v in ratios.items():
            if k.startswith(f"{t} threads/torch"):
                print(f"  {k[len(f'{t} threads/'):]:58} {v:6.2f}")
    joined["ratios"] = ratios
    with open(out_path, "w") as f:
        json.dump(joined, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
