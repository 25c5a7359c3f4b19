"""Per-kernel busy time a measured step in two kernel_trace.cc CSVs (plain or .gz) of `deltamoe bench`
at different depths, and the difference per added layer: which kernels an added layer costs, and how
often each runs, over kernel_trace.py's measured steps.
Usage: python3 kernel_trace_diff.py shallow.csv[.gz] deep.csv[.gz] added_layers [rows]"""
import csv
import gzip
import sys
from collections import defaultdict

from kernel_trace import measured_steps, short


def per_step(path):
    """(kernel -> ms a measured step, kernel -> launches a measured step) for one trace."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = sorted((int(r["start_ns"]), int(r["end_ns"]), short(r["name"])) for r in csv.DictReader(f))
    steps = measured_steps([r[2] for r in rows])
    if steps is None:
        sys.exit(f"kernel_trace_diff: fewer than 3 embedding forwards in {path}; need 2 whole steps after the first")
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
