"""Summarises an Nsight Compute CSV of `deltamoe bench` (layer_profile.sh): the last training step
(from the last embedding forward on), time per kernel name (sum, launches, mean), then every launch
of that step in order. Usage: python3 layer_profile.py ncu.csv"""
import csv
import io
import re
import sys
from collections import OrderedDict


def short(name):
    name = re.sub(r"\(.*$", "", name)        # arguments
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"deltamoe::(\(anonymous namespace\)::)?", "", name)
    return name[:110]


def main(path):
    text = open(path, errors="replace").read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    launches = []
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        launches.append((int(r["ID"]), short(r["Kernel Name"]), r["Grid Size"], r["Block Size"],
                         float(r["Metric Value"].replace(",", "")) / 1e6))  # ns -> ms
    launches.sort()
    starts = [i for i, l in enumerate(launches) if "embedding_forward" in l[1]]
    step = launches[starts[-1]:] if starts else launches
    print(f"# {len(launches)} launches in the run, {len(step)} in the last step, "
          f"{sum(l[4] for l in step):.3f} ms of kernel time in it")
    agg = OrderedDict()
    for _, n, _, _, ms in step:
        a = agg.setdefault(n, [0.0, 0])
        a[0] += ms
        a[1] += 1
    print("\n## per kernel name (last step), by total time\n")
    print(f"{'total ms':>9} {'launches':>8} {'mean ms':>8}  kernel")
    for n, (tot, cnt) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
        print(f"{tot:9.3f} {cnt:8d} {tot / cnt:8.4f}  {n}")
    print("\n## every launch of the last step, in order\n")
    for i, (_, n, g, b, ms) in enumerate(step):
        print(f"{i:5d} {ms:8.4f}  {n}  grid {g} block {b}")


if __name__ == "__main__":
    main(sys.argv[1])
