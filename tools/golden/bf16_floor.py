#!/usr/bin/env python3
# How close can bf16 training get to a golden case's fp32 gradients? Runs transformers itself on a
# committed golden case (tests/golden/<case>) in several precisions and prints, per mode, the loss
# errors and every gradient's ||diff||/||ref|| against expected.safetensors, so deltamoe's GPU
# numbers on the same case can be read against what bf16 costs in the reference implementation.
# Modes:
#   fp32            transformers in fp32 (TF32 off): must reproduce the golden file (~1e-5)
#   weights         fp32 compute on bf16-rounded weights (the CPU's "bf16 sensitivity")
#   weights+linear  also every nn.Linear's input and output, and their gradients, rounded to bf16
#   weights+linear+residual   also each decoder layer's output (the residual stream) and its gradient
#   autocast        torch.autocast(bfloat16) with fp32 weights: common mixed-precision training
#   bf16            the whole model in bfloat16 (weights, activations, gradients)
# With --write-floor, each case directory gets bf16_floor.json: per mode the loss errors, the worst
# gradient and every gradient's error. A case whose `autocast` run meets --bound on every gradient
# is fit to hold a bf16 engine to that bound (the parity checks read this file).
# With --deltamoe DIR, DIR/<case>.all.safetensors (written by `deltamoe parity --out`) is scored the
# same way and printed as one more row, so the engine and transformers' bf16 sit side by side.
# Usage (on the GPU machine, which has torch and transformers):
#   python3 tools/golden/bf16_floor.py [--device cuda] [--bound 0.02] CASE_DIR [CASE_DIR ...]
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiny_models as tm  # noqa: E402

kModes = ("fp32", "weights", "weights+linear", "weights+linear+residual", "autocast", "bf16")
# Autocast plus one more bf16 rounding each (--modes), to tell which of what autocast keeps in fp32
# a bf16 engine pays for: norm parameters, the embedding table, the residual streams (decoder
# layers' and vision blocks' outputs and their gradients).
kAutocastVariants = ("autocast+norms", "autocast+embeddings", "autocast+residual",
                     "autocast+norms+embeddings+residual")


def parse_args(argv):
    parser = argparse.ArgumentParser(description="transformers' own bf16 error on golden cases")
    parser.add_argument("cases", nargs="+", help="golden case directories (tests/golden/<case>)")
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--bound", type=float, default=2e-2, help="the ||diff||/||ref|| bar to count against")
    parser.add_argument("--show", default="", help="comma-separated substrings of gradient names to always print")
    parser.add_argument("--json", default="", help="also write every number to this file")
    parser.add_argument("--modes", default=",".join(kModes),
                        help=f"comma-separated modes (also: {', '.join(kAutocastVariants)})")
    parser.add_argument("--write-floor", action="store_true", help="write <case>/bf16_floor.json")
    parser.add_argument("--deltamoe", default="", help="folder of deltamoe parity outputs <case>.all.safetensors")
    return parser.parse_args(argv)


def make_rounder(torch):
    class RoundBf16(torch.autograd.Function):
        """Identity whose value and gradient are rounded to bf16 (stored back in the input dtype)."""

        @staticmethod
        def forward(ctx, x):
            return x.to(torch.bfloat16).to(x.dtype)

        @staticmethod
        def backward(ctx, grad):
            return grad.to(torch.bfloat16).to(grad.dtype)

    return RoundBf16.apply


def install_rounding(torch, model, linear, residual):
    """Hooks that round activations and their gradients to bf16; returns the handles."""
    round_bf16 = make_rounder(torch)
    handles = []

    def round_tree(value):
        if torch.is_tensor(value) and value.is_floating_point():
            return round_bf16(value)
        if isinstance(value, tuple):
            return tuple(round_tree(v) for v in value)
        return value

    for module in model.modules():
        if linear and isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_pre_hook(lambda _m, args: round_tree(args)))
            handles.append(module.register_forward_hook(lambda _m, _args, out: round_tree(out)))
        if residual and type(module).__name__.endswith(("DecoderLayer", "VisionBlock")):
            handles.append(module.register_forward_hook(lambda _m, _args, out: round_tree(out)))
    return handles


def load_case(torch, case_dir, device):
    from safetensors.torch import load_file

    with open(os.path.join(case_dir, "case.json")) as handle:
        info = json.load(handle)
    model_class = tm._import_class(info["class"])
    model = model_class.from_pretrained(os.path.join(case_dir, "model"), dtype=torch.float32)
    tm.select_plain_backends(model)
    model.eval()
    inputs = {k: v.to(device) for k, v in load_file(os.path.join(case_dir, "inputs.safetensors")).items()}
    expected = load_file(os.path.join(case_dir, "expected.safetensors"))
    return model, inputs, expected


def run_mode(torch, model_cases, model, inputs, mode, device):
    """ce, aux and {grad.<name>, grad_aux.<name>: fp32 cpu tensor} of transformers in `mode`."""
    import copy

    work = copy.deepcopy(model).to(device)
    handles = []
    if mode == "bf16":
        work = work.to(torch.bfloat16)
        inputs = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in inputs.items()}
    if mode.startswith("weights"):
        with torch.no_grad():
            for parameter in work.parameters():
                parameter.copy_(parameter.to(torch.bfloat16).float())
        handles = install_rounding(torch, work, "linear" in mode, "residual" in mode)
    if mode.startswith("autocast+"):
        with torch.no_grad():
            for module in work.modules():
                rounded = ("norms" in mode and "Norm" in type(module).__name__) or (
                    "embeddings" in mode and module is work.get_input_embeddings())
                for parameter in (module.parameters(recurse=False) if rounded else ()):
                    parameter.copy_(parameter.to(torch.bfloat16).float())
        handles = install_rounding(torch, work, False, "residual" in mode)
    context = (torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16) if mode.startswith("autocast")
               else torch.autocast(device_type="cpu", enabled=False))
    with context:
        outputs = model_cases._forward(work, inputs)
        ce = model_cases.causal_lm_ce(outputs.logits, inputs["labels"])
        aux = outputs.aux_loss
    names, params = zip(*[(n, p) for n, p in work.named_parameters() if p.requires_grad])
    grads_ce = torch.autograd.grad(ce, params, retain_graph=True, allow_unused=True)
    grads_aux = torch.autograd.grad(aux, params, allow_unused=True)
    grads = {}
    for name, param, g_ce, g_aux in zip(names, params, grads_ce, grads_aux):
        for prefix, g in (("grad.", g_ce), ("grad_aux.", g_aux)):
            grads[prefix + name] = (torch.zeros(param.shape) if g is None else g.detach().float().cpu())
    for handle in handles:
        handle.remove()
    return ce.item(), aux.item(), grads


def rel_l2(torch, value, reference):
    denominator = reference.double().norm().item()
    difference = (value.double() - reference.double()).norm().item()
    return difference / denominator if denominator > 0 else (0.0 if difference == 0 else float("inf"))


def write_floor(torch, case_dir, device, bound, modes):
    """<case_dir>/bf16_floor.json: what each precision costs transformers on this case."""
    import transformers

    summary = {"note": "transformers' own gradients in each precision vs expected.safetensors "
                       "(tools/golden/bf16_floor.py); fit_for_bound: the autocast run meets it",
               "transformers": transformers.__version__, "torch": torch.__version__, "device": device,
               "bound": bound, "modes": {}}
    for mode, numbers in modes.items():
        if mode == "deltamoe":
            continue
        gradients = {name: float(f"{error:.4g}") for name, error in sorted(numbers["gradients"].items())}
        worst = max(gradients.items(), key=lambda item: item[1])
        summary["modes"][mode] = {"ce_rel": numbers["ce_rel"], "aux_rel": numbers["aux_rel"],
                                  "worst": worst[1], "worst_name": worst[0], "gradients": gradients}
    summary["fit_for_bound"] = summary["modes"]["autocast"]["worst"] <= bound
    with open(os.path.join(case_dir, "bf16_floor.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    print(f"  wrote {os.path.join(case_dir, 'bf16_floor.json')}: fit for {bound}: {summary['fit_for_bound']}")


def main(argv):
    args = parse_args(argv)
    tm.block_fast_kernels()  # the golden files come from the torch fallbacks
    import torch

    import model_cases

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = args.device if (args.device == "cpu" or torch.cuda.is_available()) else "cpu"
    show = [s for s in args.show.split(",") if s]
    report = {}
    for case_dir in args.cases:
        case = os.path.basename(os.path.normpath(case_dir))
        model, inputs, expected = load_case(torch, case_dir, device)
        print(f"== {case} on {device}: transformers' gradients in each precision vs the fp32 golden file")
        report[case] = {}
        modes = tuple(m for m in args.modes.split(",") if m)
        unknown = [m for m in modes if m not in kModes + kAutocastVariants]
        if unknown:
            raise SystemExit(f"bf16_floor.py: unknown --modes {unknown}")
        if args.write_floor and not {"autocast", "bf16"} <= set(modes):
            raise SystemExit("bf16_floor.py: --write-floor needs the autocast and bf16 modes")
        if args.deltamoe and os.path.exists(os.path.join(args.deltamoe, f"{case}.all.safetensors")):
            modes = modes + ("deltamoe",)
        for mode in modes:
            if mode == "deltamoe":
                from safetensors.torch import load_file

                produced = load_file(os.path.join(args.deltamoe, f"{case}.all.safetensors"))
                ce, aux = produced["ce_loss"].item(), produced["aux_loss"].item()
                grads = {k: v.float() for k, v in produced.items() if k.startswith("grad")}
            else:
                ce, aux, grads = run_mode(torch, model_cases, model, inputs, mode, device)
            ce_rel = abs(ce - expected["ce_loss"].item()) / abs(expected["ce_loss"].item())
            aux_rel = abs(aux - expected["aux_loss"].item()) / abs(expected["aux_loss"].item())
            errors = {name: rel_l2(torch, grads[name], expected[name]) for name in grads
                      if name in expected and expected[name].abs().max().item() > 0}
            ordered = sorted(errors.items(), key=lambda item: -item[1])
            over = [name for name, error in ordered if error > args.bound]
            print(f"  {mode:24s} ce rel {ce_rel:.2e}  aux rel {aux_rel:.2e}  {len(errors)} gradients, "
                  f"worst {ordered[0][1]:.3e} ({ordered[0][0]}), {len(over)} over {args.bound}")
            for name, error in ordered[:6]:
                print(f"      {error:.3e}  {name}")
            for name, error in ordered[6:]:
                if any(s in name for s in show):
                    print(f"      {error:.3e}  {name}")
            report[case][mode] = {"ce_rel": ce_rel, "aux_rel": aux_rel, "gradients": errors}
        if "deltamoe" in report[case]:
            engine = report[case]["deltamoe"]["gradients"]
            for mode in ("autocast", "bf16"):
                if mode not in report[case]:
                    continue
                floor = report[case][mode]["gradients"]
                ratios = sorted(((engine[n] / max(floor[n], 1e-12), n) for n in engine if n in floor), reverse=True)
                beyond = [n for n in engine if engine[n] > args.bound and floor.get(n, 0) <= args.bound]
                print(f"  deltamoe / transformers {mode}: median ratio {ratios[len(ratios) // 2][0]:.2f}, "
                      f"largest {ratios[0][0]:.2f} ({ratios[0][1]}); over {args.bound} where {mode} is not: "
                      f"{len(beyond)} {sorted(beyond)[:6]}")
        if args.write_floor:
            write_floor(torch, case_dir, device, args.bound, report[case])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
