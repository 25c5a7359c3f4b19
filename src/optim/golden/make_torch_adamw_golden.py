#!/usr/bin/env python3
"""Writes the torch reference that src/optim/adamw_golden_test.cc compares against.

Runs torch.optim.AdamW (CPU, fp32, single-tensor path), torch.nn.utils.clip_grad_norm_ and
transformers' get_cosine_with_min_lr_schedule_with_warmup for a few steps on two small
parameters (a matrix with weight decay, a vector without) and stores, per step, the learning
rate torch used, the gradient norm, the gradients before and after clipping, and the
parameters and moments after the step. fp32 values are stored as their uint32 bit patterns.

Needs torch and transformers (the GPU machine has them; nothing runs on the GPU):
    python3 src/optim/golden/make_torch_adamw_golden.py --out "$OUT/torch_adamw.json"
then copy the file to src/optim/testdata/torch_adamw.json and commit it.
"""
import argparse
import json
import math
import platform
import struct
import tempfile

import torch

kTotalSteps = 12
kWarmupSteps = 3
kLr = 5e-2
kMinLr = 5e-3
kBetas = (0.9, 0.95)
kEps = 1e-8
kWeightDecay = 0.1
kMaxGradNorm = 1.0
# warmup_ratio cases checked against TrainingArguments.get_warmup_steps (ceil in fp64); every one
# must get an integer from transformers (adamw_golden_test fails on a null).
kWarmupRatioCases = [(100, 0.03), (100, 0.07), (7, 0.05), (1000, 0.1), (333, 0.01)]


def bits(tensor):
    """uint32 bit patterns of an fp32 tensor, flattened."""
    flat = tensor.detach().to(torch.float32).contiguous().view(-1).tolist()
    return [struct.unpack("<I", struct.pack("<f", value))[0] for value in flat]


def hf_warmup_steps(total_steps, ratio):
    """Warmup steps for `ratio` of `total_steps` as transformers' Trainer resolves them.

    transformers < 5.2 takes the ratio as TrainingArguments(warmup_ratio=...); 5.2 removed that
    field and reads a float warmup_steps below 1 as the same ratio. Either way get_warmup_steps
    answers. Any failure propagates: a golden without transformers' answer must not be written.
    """
    from transformers import TrainingArguments

    assert 0 < ratio < 1, f"warmup ratio {ratio}: only ratios in (0, 1) mean the same in both APIs"
    fields = TrainingArguments.__dataclass_fields__
    ratio_argument = {"warmup_ratio": ratio} if "warmup_ratio" in fields else {"warmup_steps": ratio}
    with tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(output_dir=out_dir, report_to=[], **ratio_argument)
        steps = args.get_warmup_steps(total_steps)
    if not isinstance(steps, int) or isinstance(steps, bool):
        raise TypeError(f"get_warmup_steps({total_steps}) with {ratio_argument} returned {steps!r}, not an int")
    return steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output JSON path")
    args = parser.parse_args()

    import transformers
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    torch.manual_seed(1234)
    weight = torch.nn.Parameter(torch.randn(7, 5) * 0.5)
    bias = torch.nn.Parameter(torch.randn(13) * 0.5)
    params = [("w", weight, True), ("b", bias, False)]
    record = {
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "config": {"lr": kLr, "min_lr": kMinLr, "warmup_steps": kWarmupSteps, "total_steps": kTotalSteps,
                   "beta1": kBetas[0], "beta2": kBetas[1], "eps": kEps, "weight_decay": kWeightDecay,
                   "max_grad_norm": kMaxGradNorm},
        "params": [{"name": name, "shape": list(p.shape), "decay": decay, "init": bits(p)}
                   for name, p, decay in params],
        "steps": [],
    }
    optimizer = torch.optim.AdamW(
        [{"params": [weight], "weight_decay": kWeightDecay}, {"params": [bias], "weight_decay": 0.0}],
        lr=kLr, betas=kBetas, eps=kEps, foreach=False, fused=False)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=kWarmupSteps, num_training_steps=kTotalSteps, min_lr=kMinLr)

    for step in range(kTotalSteps):
        # Gradient sizes vary so that some steps clip and some do not.
        scale = 0.05 if step % 3 == 0 else 1.0
        for _, p, _ in params:
            p.grad = torch.randn(p.shape) * scale
        raw = {name: bits(p.grad) for name, p, _ in params}
        norm = torch.nn.utils.clip_grad_norm_([weight, bias], kMaxGradNorm, foreach=False)
        lr = optimizer.param_groups[0]["lr"]
        assert optimizer.param_groups[1]["lr"] == lr
        clipped = {name: bits(p.grad) for name, p, _ in params}
        optimizer.step()
        scheduler.step()
        record["steps"].append({
            "lr": lr,
            "grad_norm": float(norm),
            "grads_raw": raw,
            "grads_clipped": clipped,
            "params_after": {name: bits(p) for name, p, _ in params},
            "exp_avg": {name: bits(optimizer.state[p]["exp_avg"]) for name, p, _ in params},
            "exp_avg_sq": {name: bits(optimizer.state[p]["exp_avg_sq"]) for name, p, _ in params},
        })
    record["lr_after_last_step"] = optimizer.param_groups[0]["lr"]  # the schedule at s = N
    record["warmup_ratio_cases"] = [
        {"total_steps": total, "warmup_ratio": ratio, "warmup_steps": hf_warmup_steps(total, ratio)}
        for total, ratio in kWarmupRatioCases]
    print(f"{kTotalSteps} steps; torch {torch.__version__}, transformers {transformers.__version__}")
    print("lrs:", [s["lr"] for s in record["steps"]], "final", record["lr_after_last_step"])
    print("norms:", [round(s["grad_norm"], 4) for s in record["steps"]])
    print("warmup ratio cases:", record["warmup_ratio_cases"])
    assert all(math.isfinite(s["grad_norm"]) for s in record["steps"])
    assert all(isinstance(c["warmup_steps"], int) for c in record["warmup_ratio_cases"])
    with open(args.out, "w") as out:
        json.dump(record, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
