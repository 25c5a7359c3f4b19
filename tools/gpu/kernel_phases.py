"""Per-kernel time in the phases of any traced program (kernel_trace.cc's CSV, plain or .gz), for test
programs that time a pass several times rather than `deltamoe bench` steps (kernel_trace.py): the
trace is cut into phases wherever the GPU idles longer than --gap ms (a test's host work between its
timed loops), each phase listed with its records and busy time, then the chosen phases' kernels by
time, divided by --reps (the passes a phase holds: a timing loop's warm-up plus its runs).
Usage: python3 kernel_phases.py trace.csv[.gz] [--gap MS] [--phases I,J] [--reps N] [--top K]
E.g. gpu_vision_model_gpu_test's TimingFullTower (one warm-up and five runs of the forward, then of
the backward, per batch): the two largest phases of a batch are its forward and backward, --reps 6."""
import argparse
import csv
import gzip
from collections import defaultdict

from kernel_trace import short


def read(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = [(int(r["start_ns"]), int(r["end_ns"]), r["kind"], r["name"], r["grid"], r["block"])
                for r in csv.DictReader(f)]
    return sorted(rows)


def phases(rows, gap_ns):
    """Runs of records whose starts follow the latest end so far by at most gap_ns."""
    cut, latest_end = [0], rows[0][1] if rows else 0
    for i in range(1, len(rows)):
        if rows[i][0] - latest_end > gap_ns:
            cut.append(i)
        latest_end = max(latest_end, rows[i][1])
    cut.append(len(rows))
    return [rows[a:b] for a, b in zip(cut, cut[1:])]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--gap", type=float, default=20.0, help="idle ms that separates phases")
    parser.add_argument("--phases", default="", help="comma-separated phase numbers to break down")
    parser.add_argument("--reps", type=float, default=1.0, help="passes per phase: times are divided by it")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    parts = phases(read(args.trace), args.gap * 1e6)
    for i, part in enumerate(parts):
        busy = sum(e - s for s, e, *_ in part) / 1e6
        print(f"phase {i}: {len(part)} records, busy {busy:.2f} ms, span {(part[-1][1] - part[0][0]) / 1e6:.2f} ms")
    for index in (int(x) for x in args.phases.split(",") if x):
        total, count = defaultdict(float), defaultdict(int)
        for s, e, kind, name, grid, block in parts[index]:
            key = f"{short(name) if kind == 'kernel' else name} [{grid}|{block}]"
            total[key] += (e - s) / 1e6
            count[key] += 1
        print(f"\nphase {index}: busy {sum(total.values()) / args.reps:.3f} ms a pass")
        for key, ms in sorted(total.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"{ms / args.reps:9.3f} ms {count[key] / args.reps:7.1f} x {1e3 * ms / count[key]:8.1f} us  {key}")


if __name__ == "__main__":
    main()
