#!/usr/bin/env python3
"""Self and inclusive host time per function from bench/host_sampler.cpp's stacks.

    python3 bench/host_profile.py samples.txt [--section K] [--top 40] [--calls N]

Each line of samples.txt is "K|" (the section the program recorded it under) and one stack of
"object+0xoffset" frames, innermost first. Frames are
named with addr2line (binutils); a return address is looked up one byte back so that it names the
call, not the instruction after it. With --calls N (the number of calls the samples covered), the
tables also give microseconds per call at the sampler's 200 µs period.
"""
import argparse
import collections
import subprocess
import sys

PERIOD_US = 200.0  # host_sampler.cpp kPeriodNs


def symbolize(frames_by_object):
    names = {}
    for obj, offsets in frames_by_object.items():
        offsets = sorted(offsets)
        if obj == "?":
            for off in offsets:
                names[(obj, off)] = "?"
            continue
        try:
            text = subprocess.run(["addr2line", "-f", "-C", "-e", obj] + [hex(o) for o in offsets],
                                  check=True, capture_output=True, text=True).stdout.splitlines()
        except (OSError, subprocess.CalledProcessError):
            text = []
        short = obj.rsplit("/", 1)[-1]
        for i, off in enumerate(offsets):
            fn = text[2 * i] if 2 * i < len(text) else "??"
            names[(obj, off)] = fn if fn != "??" else f"{short}+{hex(off)}"
    return names


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("samples")
    ap.add_argument("--section", type=int, default=0, help="only this section's samples (0: all)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--calls", type=int, default=0)
    ap.add_argument("--width", type=int, default=110)
    args = ap.parse_args()

    stacks = []
    frames_by_object = collections.defaultdict(set)
    with open(args.samples) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            section, _, line = line.partition("|")
            if args.section and int(section) != args.section:
                continue
            stack = []
            for k, frame in enumerate(line.split(";")):
                obj, _, off = frame.rpartition("+")
                off = int(off, 16)
                if k > 0 and off > 0:
                    off -= 1  # a return address: the call is the byte before
                stack.append((obj, off))
                frames_by_object[obj].add(off)
            stacks.append(stack)
    if not stacks:
        sys.exit("no samples")
    names = symbolize(frames_by_object)

    self_count = collections.Counter()
    incl_count = collections.Counter()
    for stack in stacks:
        fns = [names[fr] for fr in stack]
        self_count[fns[0]] += 1
        for fn in set(fns):
            incl_count[fn] += 1
    total = len(stacks)

    def table(title, counter):
        print(f"\n{title} ({total} samples of {PERIOD_US:.0f} µs)")
        head = f"{'share':>7} {'µs/call':>9}  function" if args.calls else f"{'share':>7}  function"
        print(head)
        for fn, c in counter.most_common(args.top):
            share = 100.0 * c / total
            per_call = f" {c * PERIOD_US / args.calls:9.1f}" if args.calls else ""
            print(f"{share:6.1f}%{per_call}  {fn[:args.width]}")

    table("self time", self_count)
    table("inclusive time", incl_count)


if __name__ == "__main__":
    main()
