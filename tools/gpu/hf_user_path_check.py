#!/usr/bin/env python3
"""Checks with Hugging Face tools what deltamoe leaves for a user (issue 21); run where torch and
transformers are installed (the GPU machine), from the repository root:

  1. a checkpoint from `deltamoe init` (with the demo tokenizer) and one from the demo's training load
     in Qwen3_5MoeForConditionalGeneration with no missing or unexpected keys;
  2. their generation_config.json makes generate() stop at <|im_end|>: the demo checkpoint answers
     its question and stops; the init checkpoint (random weights) is steered to <|im_end|> after
     three tokens by a logits processor and must stop there, well before max_new_tokens;
  3. AutoProcessor loads from each folder and apply_chat_template renders a chat with an image
     (the image tokens match the processor's grid) that the model takes in a forward pass;
  4. TensorBoard's EventAccumulator reads the event files of a `--report_to tensorboard` run (skipped
     with a line when the tensorboard package is not installed).

usage: hf_user_path_check.py --init DIR --demo DIR [--events DIR --steps N]
Prints one PASS/FAIL/SKIP line per check; exits 1 when a check failed.
"""
import argparse
import sys

import numpy as np
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer, LogitsProcessor, LogitsProcessorList
from transformers import Qwen3_5MoeForConditionalGeneration

FAILURES = []


def report(ok, name, detail):
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


class ForceTokenAt(LogitsProcessor):
    """Makes `token` the only choice once `after` new tokens exist (steers a random model)."""

    def __init__(self, prompt_length, token, after):
        self.prompt_length, self.token, self.after = prompt_length, token, after

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.prompt_length >= self.after:
            scores = torch.full_like(scores, float("-inf"))
            scores[:, self.token] = 0
        return scores


def check_checkpoint(name, path, trained):
    model, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(path, torch_dtype=torch.float32,
                                                                      output_loading_info=True)
    model.eval()
    problems = {k: v for k, v in info.items() if v}
    report(not problems, f"{name} load", problems or "all keys matched")
    tokenizer = AutoTokenizer.from_pretrained(path)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    report(im_end in eos, f"{name} generation_config", f"eos_token_id {eos}, <|im_end|> = {im_end}")

    messages = [{"role": "user", "content": "Which day comes after Monday?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    max_new = 40
    processors = None if trained else LogitsProcessorList([ForceTokenAt(ids.shape[1], im_end, 3)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=max_new, do_sample=False, logits_processor=processors)
    new = out[0, ids.shape[1]:].tolist()
    text = tokenizer.decode(new)
    report(len(new) < max_new and new[-1] == im_end, f"{name} generate() stops at <|im_end|>",
           f"{len(new)} new tokens: {text!r}")

    processor = AutoProcessor.from_pretrained(path)
    image = Image.fromarray((np.random.default_rng(0).random((64, 96, 3)) * 255).astype(np.uint8))
    chat = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What colour?"}]}]
    inputs = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    pad = model.config.image_token_id
    grid = inputs["image_grid_thw"][0]
    merge = model.config.vision_config.spatial_merge_size
    want = int(grid.prod()) // (merge * merge)
    got = int((inputs["input_ids"] == pad).sum())
    with torch.no_grad():
        logits = model(**inputs).logits
    report(got == want and torch.isfinite(logits).all().item(), f"{name} AutoProcessor.apply_chat_template with an image",
           f"{got} image tokens for grid {grid.tolist()} (want {want}), logits {tuple(logits.shape)}")


def check_events(path, steps):
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        print("SKIP tensorboard: the tensorboard package is not installed (event_file_test checks the format)")
        return
    accumulator = EventAccumulator(path)
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    loss = accumulator.Scalars("train/loss") if "train/loss" in tags else []
    report(len(loss) == steps and all(np.isfinite(e.value) for e in loss), "tensorboard reads the events",
           f"tags {sorted(tags)}, train/loss at steps {[e.step for e in loss]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", required=True)
    parser.add_argument("--demo", required=True)
    parser.add_argument("--events")
    parser.add_argument("--steps", type=int, default=0)
    args = parser.parse_args()
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for name, path, trained in [("init", args.init, False), ("demo", args.demo, True)]:
        try:
            check_checkpoint(name, path, trained)
        except Exception as error:  # one broken checkpoint must not hide the other's results
            report(False, f"{name} checks", f"{type(error).__name__}: {error}")
    if args.events:
        check_events(args.events, args.steps)
    print(f"{len(FAILURES)} failed: {FAILURES}" if FAILURES else "all passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
