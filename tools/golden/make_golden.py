#!/usr/bin/env python3
# Writes the golden files that the C++ CPU reference is tested against: tiny random
# Qwen3.5-MoE text/VLM models with inputs, logits, losses and all gradients (fp32, CPU,
# eager attention, eager experts, torch GDN fallback), plus an image-preprocessing set.
# Usage: make_golden.py --out DIR [--cases all|text|vlm|preprocess]   (see README.md)
import argparse
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def log(message):
    print(message, flush=True)


def versions():
    import torch
    import transformers
    info = {"transformers": transformers.__version__, "torch": torch.__version__,
            "python": platform.python_version()}
    try:
        import safetensors
        info["safetensors"] = safetensors.__version__
    except Exception:
        pass
    return info


def parse_args(argv):
    parser = argparse.ArgumentParser(description="Write golden files for the deltamoe CPU reference.")
    parser.add_argument("--out", required=True, help="output directory (becomes tests/golden)")
    parser.add_argument("--cases", default="all", choices=["all", "text", "vlm", "preprocess"],
                        help="which group of cases to write")
    parser.add_argument("--only", default="", help="comma-separated case names (default: the whole group)")
    return parser.parse_args(argv)


def main(argv):
    args = parse_args(argv)
    import tiny_models

    hidden = tiny_models.block_fast_kernels()  # before transformers is imported
    if hidden:
        log(f"golden: hiding installed {hidden} so that transformers uses its torch fallbacks")
    import torch

    import model_cases
    import preprocess_cases

    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    info = versions()
    log(f"golden: python {info['python']}, torch {info['torch']}, transformers {info['transformers']}, "
        f"safetensors {info.get('safetensors', '?')}")
    os.makedirs(args.out, exist_ok=True)
    only = {name for name in args.only.split(",") if name}

    written = 0
    total_bytes = 0
    started = time.time()
    if args.cases in ("all", "text", "vlm"):
        tiny_models.check_no_fast_kernels()
        for case in model_cases.all_cases():
            if args.cases not in ("all", case.kind) or (only and case.name not in only):
                continue
            total_bytes += model_cases.run_model_case(case, args.out, info, log)
            written += 1
    if args.cases in ("all", "preprocess") and (not only or "preprocess" in only):
        log("== preprocessing set")
        size, count = preprocess_cases.run_preprocess_cases(args.out, info, log)
        total_bytes += size
        written += count
    if written == 0:
        raise tiny_models.GoldenError(f"no case matched --cases {args.cases} --only {args.only!r}")
    log(f"total {total_bytes / 1e6:.2f} MB in {args.out}, {time.time() - started:.1f} s")
    log(f"GOLDEN OK {written} cases")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception as error:  # one clear line for the log, then the traceback for detail
        traceback.print_exc()
        print(f"GOLDEN FAILED: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
