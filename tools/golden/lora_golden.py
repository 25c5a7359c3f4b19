#!/usr/bin/env python3
# LoRA golden files and PEFT round-trip checks for deltamoe (issue 19), run where transformers and
# peft are installed (the GPU machine; everything here runs on the CPU in fp32).
#
#   lora_golden.py golden --golden-dir tests/golden --out DIR
#       For each case below: loads the committed tiny model and inputs of a base golden case,
#       attaches PEFT LoRA on target_modules="all-linear" and on the routed experts' fused 3-D
#       weights (target_parameters), gives every lora_B deterministic random values (so that the
#       gradients of lora_A are not zero), and writes DIR/<case>/:
#         adapter/                 PEFT's save_pretrained output (adapter_model.safetensors,
#                                  adapter_config.json): what deltamoe's loader reads
#         expected.safetensors     f32: ce_loss [], aux_loss [], logits [B,S,V],
#                                  grad.<adapter key>, grad_aux.<adapter key> (keys as saved, i.e.
#                                  base_model.model.<module>.lora_A.weight), merged.<param> (the
#                                  merge_and_unload() weights of every parameter an adapter touched)
#         case.json                base case, LoRA config, the modules and parameters PEFT targeted
#                                  (all-linear resolved), versions, router margins
#   lora_golden.py make-inputs --vocab V --out FILE
#       Random text inputs (input_ids, labels [1, S]) for `deltamoe parity` on a given model.
#   lora_golden.py check --base MODEL --adapter DIR --merged DIR --inputs FILE --parity FILE --out JSON
#       Loads a deltamoe-written adapter with PeftModel.from_pretrained and compares its logits with
#       deltamoe's (`deltamoe parity --adapters DIR` output), checks that the adapter's keys are
#       exactly PEFT's, and compares the checkpoint written by `deltamoe export --merge_lora true`
#       with PEFT's merge_and_unload() (weights and logits). Exits 1 on any mismatch.
import argparse
import json
import os
import platform
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiny_models as tm  # noqa: E402  (block_fast_kernels must run before transformers is imported)

kExpertParameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# lora_B ~ normal(0, kBStd): large enough that every lora_A gradient is clearly nonzero, small
# enough that the routers keep their margins (checked).
kBStd = 0.1
kLogitTolerance = 1e-4  # relative to max(1, max|logits|), fp32 against fp32

CASES = [
    dict(name="text_lora", base="text_router_margin", kind="text", r=4, alpha=8, rslora=False, seed=2101),
    dict(name="vlm_lora", base="vlm_router_margin", kind="vlm", r=4, alpha=16, rslora=True, seed=2102),
]


def log(message):
    print(message, flush=True)


def versions():
    import peft
    import torch
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__}


def model_class(kind):
    return tm._import_class("Qwen3_5MoeForCausalLM" if kind == "text" else "Qwen3_5MoeForConditionalGeneration")


def load_model(model_dir, kind):
    import torch
    cls = model_class(kind)
    try:
        model = cls.from_pretrained(model_dir, dtype=torch.float32)
    except TypeError:
        model = cls.from_pretrained(model_dir, torch_dtype=torch.float32)
    tm.select_plain_backends(model)
    model.eval()
    return model


def load_inputs(path):
    from safetensors.torch import load_file
    return load_file(path)


def saved_key(param_name):
    """named_parameters() name of an adapter tensor -> its key in adapter_model.safetensors."""
    return param_name.replace(".default.", ".")


def lora_config(r, alpha, rslora):
    from peft import LoraConfig
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, use_rslora=rslora, bias="none",
                      target_modules="all-linear", target_parameters=list(kExpertParameters))


def run_case(case, golden_dir, out_dir, info):
    import model_cases  # the golden cases' forward and loss (imports torch: after tiny_models)
    import torch
    from peft import get_peft_model
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    log(f"== {case['name']}: base {case['base']}, r {case['r']}, alpha {case['alpha']}, rslora {case['rslora']}")
    base_dir = os.path.join(golden_dir, case["base"])
    model = load_model(os.path.join(base_dir, "model"), case["kind"])
    inputs = load_inputs(os.path.join(base_dir, "inputs.safetensors"))
    base_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(case["seed"])
    peft_model = get_peft_model(model, lora_config(case["r"], case["alpha"], case["rslora"]))
    tm.select_plain_backends(peft_model.base_model.model)
    peft_model.eval()
    generator = torch.Generator().manual_seed(case["seed"] + 1)
    trainable = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
    with torch.no_grad():
        for name, param in trainable:
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * kBStd)
    names = [n for n, _ in trainable]
    if any(".lora_A." not in n and ".lora_B." not in n for n in names):
        raise tm.GoldenError(f"trainable tensors other than adapters: {[n for n in names if 'lora_' not in n][:5]}")
    state_keys = set(get_peft_model_state_dict(peft_model).keys())
    if {saved_key(n) for n in names} != state_keys:
        raise tm.GoldenError(f"saved keys differ from parameter names: {sorted(state_keys)[:4]} vs {names[:4]}")

    outputs = model_cases._forward(peft_model, inputs)
    ce = model_cases.causal_lm_ce(outputs.logits, inputs["labels"])
    aux = outputs.aux_loss
    coef = model_cases._text_config(model).router_aux_loss_coef
    if abs((ce + coef * aux).item() - outputs.loss.item()) > 1e-5 * max(1.0, abs(outputs.loss.item())):
        raise tm.GoldenError(f"own CE {ce.item()} + {coef} * aux {aux.item()} != transformers loss {outputs.loss.item()}")
    logit_gap, prob_gap = tm.router_margins(outputs.router_logits, model_cases._text_config(model).num_experts_per_tok)
    log(f"  ce {ce.item():.6f} aux {aux.item():.6f}; router gap with adapters: logit {logit_gap:.3e}")
    if logit_gap < tm.kMinRouterLogitGap:
        raise tm.GoldenError(f"router logit gap {logit_gap} under {tm.kMinRouterLogitGap} with the adapters")
    params = [p for _, p in trainable]
    grads_ce = torch.autograd.grad(ce, params, retain_graph=True, allow_unused=True)
    grads_aux = torch.autograd.grad(aux, params, allow_unused=True)
    expected = {"ce_loss": ce.detach().float().reshape(()), "aux_loss": aux.detach().float().reshape(()),
                "logits": outputs.logits.detach().float().contiguous()}
    zero_ce = []
    for name, param, g_ce, g_aux in zip(names, params, grads_ce, grads_aux):
        g_ce = torch.zeros_like(param) if g_ce is None else g_ce
        g_aux = torch.zeros_like(param) if g_aux is None else g_aux
        if g_ce.abs().max().item() == 0.0:
            zero_ce.append(name)
        expected[f"grad.{saved_key(name)}"] = g_ce.detach().float().contiguous()
        expected[f"grad_aux.{saved_key(name)}"] = g_aux.detach().float().contiguous()
    if zero_ce:
        raise tm.GoldenError(f"{len(zero_ce)} adapter tensors have an all-zero CE gradient, e.g. {zero_ce[:3]}")
    for key, value in expected.items():
        if not torch.isfinite(value).all():
            raise tm.GoldenError(f"{key} has non-finite values")

    case_dir = os.path.join(out_dir, case["name"])
    os.makedirs(case_dir, exist_ok=True)
    peft_model.save_pretrained(os.path.join(case_dir, "adapter"))
    targeted_modules = sorted(getattr(peft_model.base_model, "targeted_module_names", []))
    targeted_parameters = sorted(getattr(peft_model.base_model, "targeted_parameter_names", []))
    resolved = peft_model.peft_config["default"].target_modules
    with torch.no_grad():
        unmerged_logits = model_cases._forward(peft_model, inputs, labels=False).logits
        merged = peft_model.merge_and_unload()
        merged_logits = model_cases._forward(merged, inputs, labels=False).logits
    merge_diff = (merged_logits - unmerged_logits).abs().max().item()
    log(f"  merge_and_unload: logits max abs diff to the adapter model {merge_diff:.2e}")
    changed = 0
    for name, value in merged.named_parameters():
        if name in base_params and not torch.equal(value.detach(), base_params[name]):
            expected[f"merged.{name}"] = value.detach().float().contiguous()
            changed += 1
    save_file(expected, os.path.join(case_dir, "expected.safetensors"))
    meta = {
        "base_case": case["base"],
        "kind": case["kind"],
        "seed": case["seed"],
        "lora_B_std": kBStd,
        "r": case["r"], "lora_alpha": case["alpha"], "use_rslora": case["rslora"],
        "target_modules_requested": "all-linear",
        "target_modules_resolved": sorted(resolved) if isinstance(resolved, (set, list)) else resolved,
        "target_parameters": list(kExpertParameters),
        "targeted_module_names": targeted_modules,
        "targeted_parameter_names": targeted_parameters,
        "adapter_keys": sorted(saved_key(n) for n in names),
        "adapter_shapes": {saved_key(n): list(p.shape) for n, p in trainable},
        "merged_params": changed,
        "merge_logits_max_abs_diff": merge_diff,
        "router_min_logit_gap": logit_gap,
        "router_min_prob_gap": prob_gap,
        "ce_loss": ce.item(), "aux_loss": aux.item(),
        "backends": tm.backend_summary(merged),
        **info,
    }
    with open(os.path.join(case_dir, "case.json"), "w") as handle:
        json.dump(meta, handle, indent=1)
    log(f"  {len(names)} adapter tensors over {len(targeted_modules)} modules + {len(targeted_parameters)} "
        f"expert parameters; {changed} parameters merged; wrote {case_dir}")


def cmd_golden(args):
    tm.check_no_fast_kernels()
    info = versions()
    log(f"lora golden: {info}")
    only = {n for n in args.only.split(",") if n}
    for case in CASES:
        if only and case["name"] not in only:
            continue
        run_case(case, args.golden_dir, args.out, info)
    log("LORA GOLDEN OK")


def cmd_make_inputs(args):
    import torch
    from safetensors.torch import save_file
    generator = torch.Generator().manual_seed(args.seed)
    # Special tokens (image placeholders among them) sit at the top of the vocabulary: text ids only.
    limit = args.vocab - 512 if args.vocab > 1024 else args.vocab
    ids = torch.randint(0, limit, (1, args.length), generator=generator, dtype=torch.int64)
    labels = ids.clone()
    labels[:, : args.length // 4] = -100
    save_file({"input_ids": ids, "labels": labels}, args.out)
    log(f"inputs: [1, {args.length}] ids below {limit} -> {args.out}")


def max_rel(a, b):
    scale = max(1.0, b.abs().max().item())
    return (a - b).abs().max().item() / scale


def cmd_check(args):
    import model_cases
    import torch
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors import safe_open
    from safetensors.torch import load_file

    tm.check_no_fast_kernels()
    info = versions()
    log(f"lora check: {info}")
    with open(os.path.join(args.base, "config.json")) as handle:
        kind = "vlm" if "vision_config" in json.load(handle) else "text"
    inputs = load_inputs(args.inputs)
    report = {"versions": info, "failures": []}

    def fail(message):
        log(f"  FAIL {message}")
        report["failures"].append(message)

    # 1. The deltamoe adapter in PEFT.
    base = load_model(args.base, kind)
    peft_model = PeftModel.from_pretrained(base, args.adapter)
    tm.select_plain_backends(peft_model.base_model.model)
    peft_model.eval()
    with safe_open(os.path.join(args.adapter, "adapter_model.safetensors"), framework="pt") as handle:
        file_keys = set(handle.keys())
    model_keys = set(get_peft_model_state_dict(peft_model).keys())
    report["adapter_keys"] = len(file_keys)
    if file_keys != model_keys:
        fail(f"adapter keys differ from PEFT's: only in the file {sorted(file_keys - model_keys)[:5]}, "
             f"only in PEFT {sorted(model_keys - file_keys)[:5]}")
    loaded = load_file(os.path.join(args.adapter, "adapter_model.safetensors"))
    live = get_peft_model_state_dict(peft_model)
    for key in sorted(file_keys & model_keys):
        if not torch.equal(loaded[key].float(), live[key].float()):
            fail(f"{key} did not load as written")
            break
    nonzero_b = sum(1 for k, v in loaded.items() if ".lora_B." in k and v.abs().max().item() > 0)
    report["nonzero_lora_B"] = nonzero_b
    if nonzero_b == 0:
        fail("every lora_B of the deltamoe adapter is zero: the logits check would not test the adapters")
    parity = load_file(args.parity)
    with torch.no_grad():
        peft_logits = model_cases._forward(peft_model, inputs, labels=False).logits.float()
    dm_logits = parity["logits"].reshape(peft_logits.shape)
    rel = max_rel(dm_logits, peft_logits)
    report["adapter_logits_max_rel_diff"] = rel
    log(f"  deltamoe adapter in PEFT: logits max diff {rel:.3e} (relative to max(1, max|logits|))")
    if rel > kLogitTolerance:
        fail(f"deltamoe logits differ from PEFT's by {rel:.3e} > {kLogitTolerance}")
    base_free = load_model(args.base, kind)
    with torch.no_grad():
        base_logits = model_cases._forward(base_free, inputs, labels=False).logits.float()
    report["adapter_effect_on_logits"] = (peft_logits - base_logits).abs().max().item()
    if report["adapter_effect_on_logits"] < 1e-4:
        fail("the adapter does not change the logits: nothing was tested")

    # 2. deltamoe's merged export against PEFT's merge_and_unload.
    with torch.no_grad():
        peft_merged = peft_model.merge_and_unload()
        merged_logits = model_cases._forward(peft_merged, inputs, labels=False).logits.float()
    dm_merged = load_model(args.merged, kind)
    theirs = dict(peft_merged.named_parameters())
    ours = dict(dm_merged.named_parameters())
    if set(theirs) != set(ours):
        fail(f"merged parameter names differ: {sorted(set(theirs) ^ set(ours))[:5]}")
    worst = ("", 0.0)
    for name in sorted(set(theirs) & set(ours)):
        diff = max_rel(ours[name].detach().float(), theirs[name].detach().float())
        if diff > worst[1]:
            worst = (name, diff)
    report["merged_weights_max_rel_diff"] = {"param": worst[0], "diff": worst[1]}
    log(f"  merged weights: worst {worst[0]} {worst[1]:.3e}")
    if worst[1] > 1e-5:
        fail(f"merged weight {worst[0]} differs from PEFT's by {worst[1]:.3e}")
    with torch.no_grad():
        dm_merged_logits = model_cases._forward(dm_merged, inputs, labels=False).logits.float()
    rel = max_rel(dm_merged_logits, merged_logits)
    report["merged_logits_max_rel_diff"] = rel
    log(f"  merged export: logits max diff to PEFT's merged model {rel:.3e}")
    if rel > kLogitTolerance:
        fail(f"merged export logits differ from PEFT's merged model by {rel:.3e}")
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)
    log("LORA CHECK OK" if not report["failures"] else f"LORA CHECK FAILED ({len(report['failures'])})")
    return 0 if not report["failures"] else 1


def main(argv):
    parser = argparse.ArgumentParser(description="LoRA golden files and PEFT round-trip checks.")
    sub = parser.add_subparsers(dest="command", required=True)
    golden = sub.add_parser("golden")
    golden.add_argument("--golden-dir", default="tests/golden")
    golden.add_argument("--out", required=True)
    golden.add_argument("--only", default="")
    inputs = sub.add_parser("make-inputs")
    inputs.add_argument("--vocab", type=int, required=True)
    inputs.add_argument("--length", type=int, default=48)
    inputs.add_argument("--seed", type=int, default=7)
    inputs.add_argument("--out", required=True)
    check = sub.add_parser("check")
    for name in ("base", "adapter", "merged", "inputs", "parity", "out"):
        check.add_argument(f"--{name}", required=True)
    args = parser.parse_args(argv)
    hidden = tm.block_fast_kernels()
    if hidden:
        log(f"hiding installed {hidden} so that transformers uses its torch fallbacks")
    import torch
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    if args.command == "golden":
        os.makedirs(args.out, exist_ok=True)
        cmd_golden(args)
        return 0
    if args.command == "make-inputs":
        cmd_make_inputs(args)
        return 0
    return cmd_check(args)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception as error:
        traceback.print_exc()
        print(f"LORA GOLDEN FAILED: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
