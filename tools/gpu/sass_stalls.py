#!/usr/bin/env python3
"""Where one kernel's warps wait, from Nsight Compute's SASS source page exported as CSV
(`ncu -i R.ncu-rep --page source --csv --print-source sass`, with the SourceCounters section):
the stall reasons over the whole kernel, the samples per opcode, the shared-memory wavefronts
against the ideal (bank conflicts), the kernel cut into phases at its barriers, and the hottest
instructions. Usage: sass_stalls.py KERNEL_sass.csv [--top N] [--region LO HI] (hex addresses)."""
import argparse
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def read(path):
    rows = list(csv.reader(open(path, newline="")))
    head = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if head is None:
        sys.exit(f"{path}: no 'Address' header row: not an ncu source-page CSV")
    names = rows[head]
    return names, [r for r in rows[head + 1:] if len(r) == len(names)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--region", nargs=2, metavar=("LO", "HI"))
    args = parser.parse_args()
    names, rows = read(args.csv)
    col = {n: i for i, n in enumerate(names)}

    def num(r, name):
        try:
            return float(r[col[name]].replace(",", ""))
        except (KeyError, ValueError):
            return 0.0

    def opcode(r):
        words = r[col["Source"]].split()
        if words and words[0].startswith("@"):
            words = words[1:]
        return words[0].split(".")[0] if words else "?"

    if args.region:
        lo, hi = (int(a, 16) for a in args.region)
        for r in rows:
            if lo <= int(r[0], 16) <= hi:
                print(f"{r[0][-6:]} {num(r, SAMPLES):6.0f} {num(r, 'Instructions Executed'):10.0f} {r[col['Source']][:90]}")
        return
    total = sum(num(r, SAMPLES) for r in rows) or 1.0
    stalls = [n for n in names if n.startswith("stall_") and "Not Issued" not in n]
    by_reason = {s: sum(num(r, s) for r in rows) for s in stalls}
    print(f"{args.csv}: {len(rows)} instructions, {total:.0f} samples")
    print("  stall reasons: " + ", ".join(f"{k[6:]} {v / total:.1%}" for k, v in
                                          sorted(by_reason.items(), key=lambda kv: -kv[1])[:8]))
    waves = sum(num(r, "L1 Wavefronts Shared") for r in rows)
    ideal = sum(num(r, "L1 Wavefronts Shared Ideal") for r in rows)
    if waves:
        print(f"  shared-memory wavefronts {waves:.3g}, ideal {ideal:.3g}: {(waves - ideal) / waves:.1%} excess")
    per_op = collections.Counter()
    for r in rows:
        per_op[opcode(r)] += num(r, SAMPLES)
    print("  samples by opcode: " + ", ".join(f"{k} {v / total:.1%}" for k, v in per_op.most_common(10)))
    print("  phases (cut after each barrier or exit):")
    start, acc, ops = rows[0][0], 0.0, collections.Counter()
    for r in rows:
        acc += num(r, SAMPLES)
        ops[opcode(r)] += num(r, SAMPLES)
        source = r[col["Source"]]
        if "BAR.SYNC" in source or "EXIT" in source or r is rows[-1]:
            if acc > 0.003 * total:
                top = ", ".join(f"{k} {v / total:.1%}" for k, v in ops.most_common(4))
                print(f"    {start[-6:]}-{r[0][-6:]} {acc / total:6.1%}  ({top})")
            start, acc, ops = r[0], 0.0, collections.Counter()
    print(f"  hottest {args.top} instructions:")
    for r in sorted(rows, key=lambda r: -num(r, SAMPLES))[:args.top]:
        reasons = sorted(((num(r, s), s[6:]) for s in stalls), reverse=True)[:2]
        print(f"    {r[0][-6:]} {num(r, SAMPLES) / total:5.1%} {r[col['Source']][:58]:58} "
              + " ".join(f"{name} {count:.0f}" for count, name in reasons))


if __name__ == "__main__":
    main()
