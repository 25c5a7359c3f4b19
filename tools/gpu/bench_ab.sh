#!/usr/bin/env bash
# Two or more builds of `deltamoe bench` side by side in one call, for a change's effect on the step:
# every build at two depths, the builds alternating within each round, so that drift of the GPU
# (clocks, temperature) falls on all of them alike. Prints, per build, the step medians of each
# round, the per-layer cost (HI - LO) / (HI - LO layers) of the timed steps and of the same steps
# back to back (where work that overlaps consecutive steps shows), each component's per-layer cost, and
# the same over the rounds' medians, beside the first build's.
#   BUILDS="main=gpu_bundle/bin/deltamoe_main new=gpu_bundle/bin/deltamoe"  name=program pairs; the
#       first is the reference
#   LAYERS (default "1 5" on a GPU under 120 GiB, where 8 layers do not fit, else "4 8"),
#   ROUNDS (default 2), STEPS (default 8), BENCH_EXTRA (more bench flags, e.g. "--expert_grad_dtype f32")
# Needs gpu_bundle/env.sh (the CUDA libraries). Output: stdout and $OUT/bench_ab/ (logs, summary.md).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
: "${BUILDS:?BUILDS must name at least two builds: name=program ...}"
[ -f gpu_bundle/env.sh ] && source gpu_bundle/env.sh
out=${OUT:-/tmp}/bench_ab
mkdir -p "$out"
read -r -a builds <<< "$BUILDS"
[ "${#builds[@]}" -ge 2 ] || { echo "bench_ab: BUILDS needs two or more name=program entries"; exit 2; }
memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -dc 0-9)
layers=${LAYERS:-$([ -n "$memory_mib" ] && [ "$memory_mib" -lt 122880 ] && echo "1 5" || echo "4 8")}
read -r lo hi extra <<< "$layers"
if [ -z "${hi:-}" ] || [ -n "${extra:-}" ] || ! [ "$hi" -gt "$lo" ] 2>/dev/null; then
  echo "bench_ab: LAYERS must be two depths, the smaller first (got '$layers')"; exit 2
fi
status=0
for build in "${builds[@]}"; do
  program=${build#*=}
  [ -x "$program" ] || { echo "bench_ab: no program at $program (${build%%=*})"; exit 2; }
done
for round in $(seq 1 "${ROUNDS:-2}"); do
  for build in "${builds[@]}"; do
    name=${build%%=*} program=${build#*=}
    for depth in $lo $hi; do
      log="$out/${name}_L${depth}_r${round}.log"
      # shellcheck disable=SC2086  # BENCH_EXTRA is a list of flags
      timeout 300 "$program" bench --layers "$depth" --tokens 8192 --seqs 2 --steps "${STEPS:-8}" --warmup 2 \
        ${BENCH_EXTRA:-} > "$log" 2>&1 || { echo "bench_ab: $name at $depth layers, round $round FAILED"; status=1; }
      echo "$name L$depth round $round: $(grep -m1 'step time' "$log")"
    done
  done
done
python3 - "$out" "$lo" "$hi" "${ROUNDS:-2}" "${builds[@]}" <<'PY' | tee "$out/summary.md"
import os, statistics, sys
sys.path.insert(0, "tools/gpu")
from bench_json import read_bench_json
out, lo, hi, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
names = [b.split("=", 1)[0] for b in sys.argv[5:]]
def bench(name, depth, r):
    return read_bench_json(os.path.join(out, f"{name}_L{depth}_r{r}.log"))
span = hi - lo
rows = {}
for name in names:
    per_round, components = [], {}
    for r in range(1, rounds + 1):
        a, b = bench(name, lo, r), bench(name, hi, r)
        if a is None or b is None:
            continue
        # Back to back (one synchronisation around the steps, as a training loop runs): work that
        # overlaps the next step shows only here; the timed steps synchronise around each step.
        b2b = ((b["back_to_back_step_ms"] - a["back_to_back_step_ms"]) / span
               if "back_to_back_step_ms" in a and "back_to_back_step_ms" in b else float("nan"))
        per_round.append((a["step_ms"], b["step_ms"], (b["step_ms"] - a["step_ms"]) / span, b2b))
        for key, value in b["components_ms"].items():
            components.setdefault(key, []).append((value - a["components_ms"].get(key, 0.0)) / span)
    rows[name] = (per_round, {k: statistics.median(v) for k, v in components.items()})
print(f"| build | L{lo} step ms by round | L{hi} step ms by round | per layer by round | median per layer | against {names[0]} "
      f"| back-to-back per layer by round | median | against {names[0]} |")
print("|---|---|---|---|---|---|---|---|---|")
def reference_of(index):
    return statistics.median([p[index] for p in rows[names[0]][0]]) if rows[names[0]][0] else None
reference, reference_b2b = reference_of(2), reference_of(3)
for name in names:
    per_round = rows[name][0]
    if not per_round:
        print(f"| {name} | no result | | | | | | | |")
        continue
    median = statistics.median([p[2] for p in per_round])
    median_b2b = statistics.median([p[3] for p in per_round])
    versus = f"{median - reference:+.2f} ms" if reference is not None else ""
    versus_b2b = f"{median_b2b - reference_b2b:+.2f} ms" if reference_b2b is not None else ""
    print(f"| {name} | {' / '.join(f'{p[0]:.2f}' for p in per_round)} | {' / '.join(f'{p[1]:.2f}' for p in per_round)} "
          f"| {' / '.join(f'{p[2]:.2f}' for p in per_round)} | {median:.2f} | {versus} "
          f"| {' / '.join(f'{p[3]:.2f}' for p in per_round)} | {median_b2b:.2f} | {versus_b2b} |")
print()
print("per added layer by component, median over rounds (ms):")
for name in names:
    print(f"  {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(rows[name][1].items())))
PY
exit $status
