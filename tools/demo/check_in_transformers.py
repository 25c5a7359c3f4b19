#!/usr/bin/env python3
"""Checks a checkpoint written by `deltamoe train` with Hugging Face transformers (run where torch
and transformers are installed, e.g. the GPU machine):
  1. it loads into Qwen3_5MoeForConditionalGeneration with no missing, unexpected or mismatched keys;
  2. the tokenizer and chat template load (AutoTokenizer) and render a demo chat;
  3. transformers' logits on that chat equal `deltamoe parity`'s (fp32 CPU reference) on the same ids;
  4. greedy generation of the answer is printed (after the demo it should name the next day).

usage: check_in_transformers.py --deltamoe build/cpu/deltamoe --checkpoint out/demo/run/checkpoint-60
Exits 1 when a check fails.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, Qwen3_5MoeForConditionalGeneration


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deltamoe", required=True)
    parser.add_argument("--checkpoint", required=True)
    args = parser.parse_args()
    failures = []

    model, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(
        args.checkpoint, torch_dtype=torch.float32, output_loading_info=True)
    model.eval()
    problems = {k: v for k, v in info.items() if v}
    print(("PASS" if not problems else "FAIL") + f" load: {problems or 'all keys matched'}")
    if problems:
        failures.append("load")

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    messages = [{"role": "user", "content": "Which day comes after Monday?"},
                {"role": "assistant", "content": "Tuesday comes after Monday."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    print(f"PASS tokenizer: {ids.shape[1]} tokens for {text!r}")

    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    with tempfile.TemporaryDirectory() as work:
        save_file({"input_ids": ids.to(torch.int64).contiguous(), "labels": ids.to(torch.int64).clone()},
                  os.path.join(work, "inputs.safetensors"))
        subprocess.run([args.deltamoe, "parity", "--model", args.checkpoint, "--inputs",
                        os.path.join(work, "inputs.safetensors"), "--out", os.path.join(work, "out.safetensors")],
                       check=True)
        ours = load_file(os.path.join(work, "out.safetensors"))["logits"].float()
    rel = ((ours - logits).abs().max() / logits.abs().max()).item()
    ok = rel < 1e-4
    print(("PASS" if ok else "FAIL") + f" logits vs deltamoe parity: max rel {rel:.3e}")
    if not ok:
        failures.append("logits")

    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=prompt_ids, max_new_tokens=12, do_sample=False)
    print(f"INFO generation: {tokenizer.decode(out[0, prompt_ids.shape[1]:])!r}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
