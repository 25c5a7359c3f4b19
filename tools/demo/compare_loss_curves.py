#!/usr/bin/env python3
"""Checks that a GPU run follows the CPU reference run of the same demo (same model, data, seed and
flags): the two metrics.jsonl files must agree within bf16 noise.

bf16 noise, defined: the GPU rounds weights and activations to bf16 (about 3 significant digits)
where the CPU keeps fp32, so the two runs drift apart slowly as the updates compound. Passing means
  - every step of the first --steps steps (default 20): |loss_gpu - loss_cpu| / loss_cpu <= --tol
    (default 5%), where loss is the step's training loss (CE + weighted aux, token mean);
  - the last evaluation: |val_gpu - val_cpu| / val_cpu <= --tol;
  - both runs have the same steps and the GPU's losses are finite.
The worst step over the whole run is printed (beyond --steps it is reported, not judged).

usage: compare_loss_curves.py CPU_METRICS GPU_METRICS [--steps N] [--tol 0.05]
"""
import argparse
import json
import math
import sys


def read_metrics(path):
    train, evals = {}, {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                sys.exit(f"{path}:{number}: not a JSON line ({error})")
            if record.get("type") == "train":
                train[record["step"]] = record
            elif record.get("type") == "eval":
                evals[record["step"]] = record
    if not train:
        sys.exit(f"{path}: no training steps (\"type\": \"train\" lines)")
    return train, evals


def relative(got, ref):
    return abs(got - ref) / max(abs(ref), 1e-12)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cpu_metrics")
    parser.add_argument("gpu_metrics")
    parser.add_argument("--steps", type=int, default=20, help="steps judged one by one (from the first)")
    parser.add_argument("--tol", type=float, default=0.05, help="largest relative difference allowed")
    args = parser.parse_args()

    cpu_train, cpu_evals = read_metrics(args.cpu_metrics)
    gpu_train, gpu_evals = read_metrics(args.gpu_metrics)
    failures = []
    if sorted(cpu_train) != sorted(gpu_train):
        failures.append(f"the runs have different steps: cpu {min(cpu_train)}..{max(cpu_train)} "
                        f"({len(cpu_train)}), gpu {min(gpu_train)}..{max(gpu_train)} ({len(gpu_train)})")
    common = sorted(set(cpu_train) & set(gpu_train))
    judged = common[:args.steps]
    worst_step, worst = None, -1.0
    worst_judged_step, worst_judged = None, -1.0
    print(f"{'step':>5} {'cpu loss':>10} {'gpu loss':>10} {'rel diff':>9}")
    for step in common:
        ref, got = cpu_train[step]["loss"], gpu_train[step]["loss"]
        if got is None or not math.isfinite(got):
            failures.append(f"step {step}: the GPU loss is {got}")
            continue
        diff = relative(got, ref)
        if step in judged or step == common[-1] or step % 10 == 0:
            print(f"{step:>5} {ref:>10.4f} {got:>10.4f} {100 * diff:>8.2f}%")
        if diff > worst:
            worst_step, worst = step, diff
        if step in judged and diff > worst_judged:
            worst_judged_step, worst_judged = step, diff
    if worst_judged_step is not None:
        print(f"worst of the first {len(judged)} steps: step {worst_judged_step}, {100 * worst_judged:.2f}% "
              f"(bound {100 * args.tol:.1f}%)")
        if worst_judged > args.tol:
            failures.append(f"step {worst_judged_step}: training loss differs by {100 * worst_judged:.2f}% "
                            f"(> {100 * args.tol:.1f}%)")
    if worst_step is not None:
        print(f"worst over all {len(common)} steps: step {worst_step}, {100 * worst:.2f}% (reported only)")

    eval_steps = sorted(set(cpu_evals) & set(gpu_evals))
    if not eval_steps:
        failures.append("no evaluation step in both files (run with --val_dataset)")
    else:
        for step in eval_steps:
            ref, got = cpu_evals[step]["val_loss"], gpu_evals[step]["val_loss"]
            acc_ref, acc_got = cpu_evals[step].get("val_token_acc"), gpu_evals[step].get("val_token_acc")
            acc = "" if acc_ref is None or acc_got is None else f"  token_acc cpu {acc_ref:.3f} gpu {acc_got:.3f}"
            print(f"eval step {step}: val_loss cpu {ref:.4f} gpu {got:.4f} ({100 * relative(got, ref):.2f}%){acc}")
        last = eval_steps[-1]
        ref, got = cpu_evals[last]["val_loss"], gpu_evals[last]["val_loss"]
        if not math.isfinite(got) or relative(got, ref) > args.tol:
            failures.append(f"final validation loss (step {last}): cpu {ref:.4f}, gpu {got:.4f}, "
                            f"{100 * relative(got, ref):.2f}% apart (> {100 * args.tol:.1f}%)")

    for failure in failures:
        print(f"FAIL: {failure}")
    print("compare_loss_curves: " + ("PASS" if not failures else "FAIL") +
          f" (GPU {args.gpu_metrics} vs CPU {args.cpu_metrics})")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
