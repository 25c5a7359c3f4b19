#!/usr/bin/env python3
"""Checks deltamoe checkpoints against Hugging Face transformers (run where transformers is installed).

(a) `deltamoe init --config tiny-vl` output loads in Qwen3_5MoeForConditionalGeneration with no
    missing/unexpected/mismatched keys, with the values of the files, and runs a forward pass.
(b) A tiny-vl model built and save_pretrained()-ed by transformers (per-expert expert keys) passes
    `deltamoe inspect`; `deltamoe convert` to the kept layout, to fused, and back to per-expert
    (sharded) gives bitwise-identical tensors (same dtypes), and every output loads back in
    transformers with logits identical to the original model's.

Usage: python tools/hf_checkpoint_check.py --deltamoe build/release/deltamoe --workdir /tmp/hfcheck
Prints one PASS/FAIL line per check and a summary; exits 1 if any check failed.
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import traceback

import torch
from safetensors import safe_open

RESULTS = []  # (name, status, detail); status is PASS, FAIL or WARN


def record(name, ok, detail="", warn_only=False):
    status = "PASS" if ok else ("WARN" if warn_only else "FAIL")
    RESULTS.append((name, status, detail))
    print(f"[{status}] {name}" + (f": {detail}" if detail else ""), flush=True)
    return ok


def run_deltamoe(binary, args):
    """Runs deltamoe, returns (exit code, combined output)."""
    proc = subprocess.run([binary] + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc.returncode, proc.stdout


def read_tensors(directory):
    """All tensors of a model directory (single file or shards) by name, on CPU."""
    tensors = {}
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise RuntimeError(f"{directory}: no .safetensors files")
    for path in files:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                if name in tensors:
                    raise RuntimeError(f"{directory}: tensor {name} appears in two files")
                tensors[name] = handle.get_tensor(name)
    return tensors


def same_bits(a, b):
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def compare_tensor_sets(expected, actual):
    """Returns a list of problems (empty when every tensor matches bitwise with the same dtype)."""
    problems = []
    for name in sorted(set(expected) - set(actual)):
        problems.append(f"missing {name}")
    for name in sorted(set(actual) - set(expected)):
        problems.append(f"unexpected {name}")
    for name in sorted(set(expected) & set(actual)):
        a, b = expected[name], actual[name]
        if a.dtype != b.dtype:
            problems.append(f"{name}: dtype {b.dtype}, expected {a.dtype}")
        elif tuple(a.shape) != tuple(b.shape):
            problems.append(f"{name}: shape {tuple(b.shape)}, expected {tuple(a.shape)}")
        elif not same_bits(a, b):
            problems.append(f"{name}: values differ (max abs {(a.float() - b.float()).abs().max().item():.3g})")
    return problems


PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(tensors):
    """The fused-layout tensor set that a per-expert tensor set should convert to."""
    fused, groups = {}, {}
    for name, tensor in tensors.items():
        match = PER_EXPERT.match(name)
        if match and not name.startswith("mtp."):
            groups.setdefault(match.group(1), {}).setdefault(int(match.group(2)), {})[match.group(3)] = tensor
        else:
            fused[name] = tensor
    for prefix, experts in groups.items():
        order = sorted(experts)
        if order != list(range(len(order))):
            raise RuntimeError(f"{prefix}: expert indices are not 0..E-1")
        fused[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], dim=0) for e in order])
        fused[prefix + ".down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    return fused


FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def split_experts(tensors):
    """The per-expert tensor set that a fused tensor set should convert to."""
    split = {}
    for name, tensor in tensors.items():
        match = FUSED.match(name)
        if not match or name.startswith("mtp."):
            split[name] = tensor
            continue
        prefix, kind = match.group(1), match.group(2)
        for e in range(tensor.shape[0]):
            if kind == "gate_up_proj":
                half = tensor.shape[1] // 2
                split[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :half].contiguous()
                split[f"{prefix}.{e}.up_proj.weight"] = tensor[e, half:].contiguous()
            else:
                split[f"{prefix}.{e}.down_proj.weight"] = tensor[e].contiguous()
    return split


def load_hf(model_class, directory):
    kwargs = dict(output_loading_info=True, attn_implementation="eager")
    try:
        return model_class.from_pretrained(directory, dtype=torch.float32, **kwargs)
    except TypeError:  # older transformers spell it torch_dtype
        return model_class.from_pretrained(directory, torch_dtype=torch.float32, **kwargs)


def loading_problems(info):
    problems = []
    for key, value in (info or {}).items():
        if isinstance(value, (list, set, tuple, dict)) and len(value) > 0:
            problems.append(f"{key}: {sorted(map(str, value))[:10]}")
    return problems


def text_input_ids(config, length=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # Stay below the special-token block at the top of the vocabulary.
    high = min(config.text_config.vocab_size, config.image_token_id) - 40
    return torch.randint(0, high, (1, length), generator=generator)


@torch.no_grad()
def logits_of(model, input_ids):
    model.eval()
    return model(input_ids=input_ids).logits.float()


def check_values_match_files(model, directory):
    """Every parameter of a loaded model equals its tensor in the files (fused layout on disk)."""
    files = fuse_experts(read_tensors(directory))
    problems = []
    state = model.state_dict()
    for name, value in state.items():
        if name not in files:
            continue  # buffers such as rotary inv_freq
        stored = files[name]
        if not torch.equal(value.to(stored.dtype).cpu(), stored):
            problems.append(name)
    for name in files:
        if name not in state and not name.startswith("mtp."):
            problems.append(f"{name} (file tensor not in the model)")
    return problems


@torch.no_grad()
def try_image_forward(model, config):
    """A forward pass with one 64x64 image (grid 1x4x4 patches -> 4 tokens); raises on failure."""
    vision = config.vision_config
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    grid = torch.tensor([[1, 4, 4]])
    num_tokens = 16 // (vision.spatial_merge_size ** 2)
    pixel_values = torch.randn(16, patch_dim, generator=torch.Generator().manual_seed(1))
    ids = [config.vision_start_token_id] + [config.image_token_id] * num_tokens + [config.vision_end_token_id]
    input_ids = torch.cat([text_input_ids(config, 6), torch.tensor([ids]), text_input_ids(config, 6, seed=1)], dim=1)
    kwargs = dict(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grid)
    import inspect
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        kwargs["mm_token_type_ids"] = (input_ids == config.image_token_id).long()
    model.eval()
    logits = model(**kwargs).logits
    if not torch.isfinite(logits).all():
        raise RuntimeError("non-finite logits")
    return tuple(logits.shape)


def part_a(args, model_class):
    init_dir = os.path.join(args.workdir, "deltamoe_init")
    code, out = run_deltamoe(args.deltamoe, ["init", "--config", "tiny-vl", "--out", init_dir, "--seed", "7"])
    if not record("a: deltamoe init tiny-vl", code == 0, out.strip().splitlines()[-1] if out.strip() else ""):
        return
    model, info = load_hf(model_class, init_dir)
    problems = loading_problems(info)
    record("a: from_pretrained has no missing/unexpected/mismatched keys", not problems, "; ".join(problems))
    problems = check_values_match_files(model, init_dir)
    record("a: loaded parameters equal the file tensors", not problems, ", ".join(problems[:10]))
    logits = logits_of(model, text_input_ids(model.config))
    record("a: text forward gives finite logits", bool(torch.isfinite(logits).all()), f"shape {tuple(logits.shape)}")
    try:
        shape = try_image_forward(model, model.config)
        record("a: image forward runs", True, f"logits {shape}", warn_only=True)
    except Exception as error:  # informative only: the processor-side inputs may differ by version
        record("a: image forward runs", False, f"{type(error).__name__}: {error}", warn_only=True)


def part_b(args, model_class, config_class):
    init_dir = os.path.join(args.workdir, "deltamoe_init")
    hf_dir = os.path.join(args.workdir, "hf_saved")
    config = config_class.from_pretrained(init_dir)
    torch.manual_seed(args.seed)
    reference = model_class(config).to(torch.float32)
    reference.eval()
    reference.save_pretrained(hf_dir)
    hf_tensors = read_tensors(hf_dir)
    per_expert = any(PER_EXPERT.match(name) for name in hf_tensors)
    record("b: transformers save_pretrained layout", True,
           f"{len(hf_tensors)} tensors, experts {'per expert' if per_expert else 'fused'}")
    input_ids = text_input_ids(config)
    # Reference logits from transformers' own reload (eager attention, like every load below), so
    # that only the weights can differ between the compared runs.
    reloaded, info = load_hf(model_class, hf_dir)
    problems = loading_problems(info)
    record("b: transformers reloads its own save", not problems, "; ".join(problems))
    reference_logits = logits_of(reloaded, input_ids)

    code, out = run_deltamoe(args.deltamoe, ["inspect", hf_dir])
    record("b: deltamoe inspect of the transformers checkpoint", code == 0,
           "complete" if code == 0 else out.strip()[-2000:])

    fused_expected = fuse_experts(hf_tensors)
    conversions = [
        ("keep", hf_dir, ["--layout", "keep"], hf_tensors),
        ("fused", hf_dir, ["--layout", "fused", "--shard_size", "0"], fused_expected),
        ("per_expert_sharded", None, ["--layout", "per_expert", "--shard_size", "300000"],
         split_experts(fused_expected)),
    ]
    for name, source, flags, expected in conversions:
        source = source or os.path.join(args.workdir, "convert_fused")
        out_dir = os.path.join(args.workdir, f"convert_{name}")
        code, out = run_deltamoe(args.deltamoe, ["convert", "--in", source, "--out", out_dir] + flags)
        if not record(f"b: deltamoe convert {name}", code == 0, out.strip()[-2000:]):
            continue
        problems = compare_tensor_sets(expected, read_tensors(out_dir))
        record(f"b: {name}: tensors bitwise identical with the same dtypes", not problems,
               f"{len(expected)} tensors" if not problems else "; ".join(problems[:10]))
        model, info = load_hf(model_class, out_dir)
        problems = loading_problems(info)
        record(f"b: {name}: loads in transformers without key problems", not problems, "; ".join(problems))
        logits = logits_of(model, input_ids)
        identical = torch.equal(logits, reference_logits)
        max_diff = (logits - reference_logits).abs().max().item()
        record(f"b: {name}: logits identical to the original model", identical, f"max abs diff {max_diff:.3g}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deltamoe", required=True, help="path to the deltamoe binary")
    parser.add_argument("--workdir", required=True, help="scratch directory (emptied first)")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for the transformers-built model")
    args = parser.parse_args()
    args.deltamoe = os.path.abspath(args.deltamoe)
    if not os.access(args.deltamoe, os.X_OK):
        sys.exit(f"--deltamoe {args.deltamoe} is not an executable file")
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)

    import transformers
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, workdir {args.workdir}")
    for part in (lambda: part_a(args, Qwen3_5MoeForConditionalGeneration),
                 lambda: part_b(args, Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeConfig)):
        try:
            part()
        except Exception as error:
            traceback.print_exc()
            record("unexpected exception", False, f"{type(error).__name__}: {error}")

    failed = [r for r in RESULTS if r[1] == "FAIL"]
    warned = [r for r in RESULTS if r[1] == "WARN"]
    print("\n==== summary ====")
    for name, status, detail in RESULTS:
        print(f"{status:4}  {name}")
    print(f"{'FAIL' if failed else 'PASS'}: {len(RESULTS) - len(failed) - len(warned)} passed, "
          f"{len(failed)} failed, {len(warned)} warnings")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
