#!/usr/bin/env python3
"""Checks whether a model directory's chat template renders like one of deltamoe's renderers.

deltamoe renders chats in C++ (src/tokenizer/chat_template.cc); chat_template_test checks that code
against jinja2 on deltamoe's templates (the Qwen3.5 one in tests/tokenizer and Qwen3's). This script
renders random conversations (text, images, reasoning, tool calls, tools) with the model's template
and with those templates, as transformers' apply_chat_template does, and reports which one it
matches on every conversation, with the fingerprint `deltamoe train` prints for the template.
A template that matches can be added to kKnownTemplates (src/tokenizer/chat_template_source.cc), or
used at once with `deltamoe train --template NAME`.

usage: tools/check_chat_template.py MODEL_DIR [--count N]   (run from the repository root)
exit status 0 when it matches a renderer, 1 when not.
"""
import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "tokenizer"))
import render_chat_reference as ref  # noqa: E402  (the conversation generator of chat_template_test)


def model_template(model_dir):
    """The template transformers would load, in its order of files."""
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        return open(path, encoding="utf-8").read(), path
    path = os.path.join(model_dir, "chat_template.json")
    if os.path.isfile(path):
        return json.load(open(path, encoding="utf-8"))["chat_template"], path
    path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(path):
        template = json.load(open(path, encoding="utf-8")).get("chat_template")
        if isinstance(template, list):
            template = next(t["template"] for t in template if t.get("name") == "default")
        if template:
            return template, path
    return None, None


def fingerprint(text):
    """FNV-1a 64 over the normalised text, as chat_template_fingerprint in C++."""
    lines = [line.rstrip(" \t") for line in text.replace("\r", "").split("\n")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    value = 0xcbf29ce484222325
    for byte in "\n".join(lines).encode("utf-8"):
        value ^= byte
        value = (value * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return value


def render(template, case):
    variables = {"messages": case["messages"], "tools": case["tools"],
                 "add_generation_prompt": case["add_generation_prompt"], "add_vision_id": case["add_vision_id"]}
    if case["enable_thinking"] is not None:
        variables["enable_thinking"] = case["enable_thinking"]
    try:
        return template.render(**variables)
    except Exception:  # the template refused the conversation
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    text, source = model_template(args.model_dir)
    if text is None:
        print(f"{args.model_dir}: no chat template (deltamoe uses its Qwen3.5 renderer)")
        return 0
    env = ref.environment()
    theirs = env.from_string(text)
    with open(ref.QWEN3_CONFIG, encoding="utf-8") as f:
        qwen3 = json.load(f)["chat_template"]
    with open(ref.QWEN35_TEMPLATE, encoding="utf-8") as f:
        qwen35 = f.read()
    print(f"{source}: fingerprint {fingerprint(text):016x}")
    for name, fmt, reference in [("qwen3_5", "qwen3.5", qwen35), ("qwen3", "qwen3", qwen3)]:
        ours = env.from_string(reference)
        rng = random.Random(args.seed)
        differences = 0
        first = None
        for _ in range(args.count):
            case = {"messages": ref.conversation(rng, fmt),
                    "tools": [ref.make_tool(rng, i) for i in range(rng.randint(1, 2))] if rng.random() < 0.25 else None,
                    "add_generation_prompt": rng.random() < 0.4, "enable_thinking": rng.choice([None, True, False]),
                    "add_vision_id": fmt == "qwen3.5" and rng.random() < 0.25}
            a, b = render(theirs, case), render(ours, case)
            if a != b:
                differences += 1
                first = first or (case, a, b)
        if differences == 0:
            print(f"renders like deltamoe's {name} renderer on all {args.count} conversations: "
                  f"train with --template {name}, or add the fingerprint to kKnownTemplates")
            return 0
        print(f"differs from the {name} renderer on {differences}/{args.count} conversations")
        case, a, b = first
        print(f"  first difference, messages {json.dumps(case['messages'], ensure_ascii=False)[:300]}")
        print(f"    model template: {a!r:.300}\n    {name}:      {b!r:.300}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
