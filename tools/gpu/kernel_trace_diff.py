"""Per-kernel busy time a measured step in two kernel_trace.cc CSVs (plain or .gz) of `deltamoe bench`
at different depths, and the difference per added layer: which kernels an added layer costs, and how
often each runs. Steps are cut at the embedding forward and the first one is left out, as in
kernel_trace.py. Usage: python3 kernel_trace_diff.py shallow.csv[.gz] deep.csv[.gz] added_layers [rows]"""
import csv
import gzip
import sys
from collections import defaultdict

from kernel_trace import short


def per_step(path):
    """(kernel -> ms a measured step, kernel -> launches a measured step) for one trace."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = sorted((int(r["start_ns"]), int(r["end_ns"]), short(r["name"])) for r in csv.DictReader(f))
    starts = [i for i, r in enumerate(rows) if "embedding_forward" in r[2]]
    if len(starts) < 3:
        sys.exit(f"kernel_trace_diff: {len(starts)} embedding forwards in {path}; need 3 or more (2 whole steps)")
    steps = [(starts[k], starts[k + 1]) for k in range(1, len(starts) - 1)]
    ms, launches = defaultdict(float), defaultdict(float)
    for a, b in steps:
        for start, end, name in rows[a:b]:
            ms[name] += (end - start) / 1e6 / len(steps)
            launches[name] += 1 / len(steps)
    return ms, launches


def main(shallow, deep, added_layers, shown=60):
    a, _ = per_step(shallow)
    b, launches = per_step(deep)
    names = sorted(set(a) | set(b), key=lambda k: -(b.get(k, 0.0) - a.get(k, 0.0)))
    print(f"{'per added layer, ms':>19} | {'shallow ms':>10} | {'deep ms':>8} | deep launches | kernel")
    for name in names[:shown]:
        added = (b.get(name, 0.0) - a.get(name, 0.0)) / added_layers
        print(f"{added:19.3f} | {a.get(name, 0.0):10.3f} | {b.get(name, 0.0):8.3f} | {launches.get(name, 0):13.0f} | {name}")
    total = (sum(b.values()) - sum(a.values())) / added_layers
    print(f"busy a step: shallow {sum(a.values()):.2f} ms, deep {sum(b.values()):.2f} ms; per added layer {total:.3f} ms "
          f"({len(names)} kernel names, {max(0, len(names) - shown)} not shown)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) == 5 else 60))
