"""Where the GPU waits in `deltamoe bench`'s steps, from kernel_trace.cc's CSV: per measured step (one
embedding forward to the next) the wall time, the time some kernel, copy or fill ran (busy), and
the idle rest; then the idle time per gap site (the work before and the work the GPU waited for),
split by whether the host had queued that work when the GPU went idle (if not, the host was
behind: launch-bound or a host wait; if so, the gap is the GPU's own latency between dependent
launches). CUPTI's "submitted" time is when the GPU front end took the work, just before it ran. Usage: python3 kernel_trace.py trace.csv [label]"""
import csv
import re
import sys
from collections import defaultdict


def short(name):
    name = re.sub(r"<unnamed>::|\(anonymous namespace\)::", "", name)
    name = re.sub(r"\(.*$", "", name)  # the argument list
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"deltamoe::", "", name)
    return name[:80]


def measured_steps(names):
    """(first, next step's first) row indices of each whole measured step of a time-sorted trace, cut
    at the embedding forward, the first step (warm-up, plans, allocations) left out; None when the
    trace holds fewer than two whole steps after it."""
    starts = [i for i, name in enumerate(names) if "embedding_forward" in name]
    if len(starts) < 3:
        return None
    return [(starts[k], starts[k + 1]) for k in range(1, len(starts) - 1)]


def main(path, label):
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rows.append((int(r["start_ns"]), int(r["end_ns"]), int(r["queued_ns"] or 0), short(r["name"])))
    rows.sort()
    steps = measured_steps([r[3] for r in rows])
    if steps is None:
        print(f"kernel_trace: fewer than 3 embedding forwards in {path}; need 2 whole steps after the first")
        return 1
    walls, busys, gaps_host, gaps_gpu = [], [], [], []
    sites = defaultdict(lambda: [0.0, 0, 0.0])  # (before, after) -> [idle ns, count, host-late ns]
    for a, b in steps:
        t0, t1 = rows[a][0], rows[b][0]
        busy = idle_host = idle_gpu = 0
        frontier = t0
        prev = "(step start)"
        # The step's work, then the next step's first kernel (the idle before it belongs to this step).
        for s, e, queued, name in rows[a:b + 1]:
            if s > frontier:
                gap = s - frontier
                late = queued > frontier  # queued by the host after the GPU went idle: the host was behind
                if late:
                    idle_host += gap
                else:
                    idle_gpu += gap
                site = sites[(prev, name)]
                site[0] += gap
                site[1] += 1
                site[2] += gap if late else 0
            if s >= t1:  # the next step's first work: only the idle before it is this step's
                break
            busy += max(0, e - max(s, frontier))
            if e > frontier:
                frontier = e
                prev = name
        walls.append(t1 - t0)
        busys.append(busy)
        gaps_host.append(idle_host)
        gaps_gpu.append(idle_gpu)
    n = len(steps)
    ms = lambda ns: ns / 1e6
    wall, busy = sum(walls) / n, sum(busys) / n
    print(f"## {label}: {n} measured steps, {len(rows)} records")
    print(f"wall {ms(wall):.2f} ms a step; busy {ms(busy):.2f} ms; idle {ms(wall - busy):.2f} ms "
          f"(host behind {ms(sum(gaps_host) / n):.2f}, queued but not started {ms(sum(gaps_gpu) / n):.2f})")
    print(f"SUMMARY {label} wall_ms={ms(wall):.3f} busy_ms={ms(busy):.3f} idle_ms={ms(wall - busy):.3f} "
          f"host_behind_ms={ms(sum(gaps_host) / n):.3f}")
    print("\nidle ms a step | gaps a step | host behind ms | before -> waited for")
    for (before, after), (idle, count, late) in sorted(sites.items(), key=lambda kv: -kv[1][0])[:40]:
        print(f"{ms(idle / n):8.3f} | {count / n:6.1f} | {ms(late / n):8.3f} | {before} -> {after}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else sys.argv[1]))
