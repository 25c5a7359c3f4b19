#!/usr/bin/env python3
"""Generates the demo dataset: chat JSONL lines (Qwen messages layout) for two small tasks a tiny
model can visibly learn, with deterministic content for a given seed.
  - colour: a generated PNG with a coloured square, "What colour is the square?" -> "The square is red."
  - days:   "Which day comes after Monday?" -> "Tuesday comes after Monday."
PNGs are written with zlib only (no imaging library needed).

usage: make_data.py OUT_DIR [--train N] [--val N] [--seed S]
"""
import argparse
import json
import os
import random
import struct
import zlib

COLOURS = {
    "red": (220, 30, 30), "green": (30, 170, 60), "blue": (30, 60, 220), "yellow": (235, 215, 40),
    "purple": (140, 50, 170), "orange": (245, 140, 20), "black": (15, 15, 15), "white": (245, 245, 245),
}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
IMAGE_SIZE = 64


def png_bytes(width, height, pixel):
    """An RGB PNG; pixel(x, y) -> (r, g, b)."""
    rows = b"".join(b"\x00" + bytes(c for x in range(width) for c in pixel(x, y)) for y in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def colour_sample(rng, out_dir, index):
    name = rng.choice(sorted(COLOURS))
    colour = COLOURS[name]
    background = (128, 128, 128)
    size = rng.randint(24, 48)
    left, top = rng.randint(0, IMAGE_SIZE - size), rng.randint(0, IMAGE_SIZE - size)

    def pixel(x, y):
        return colour if left <= x < left + size and top <= y < top + size else background

    relative = f"images/square_{index:04d}.png"
    with open(os.path.join(out_dir, relative), "wb") as f:
        f.write(png_bytes(IMAGE_SIZE, IMAGE_SIZE, pixel))
    question = rng.choice(["What colour is the square?", "What colour is this square?", "Name the colour of the square."])
    return {"messages": [
        {"role": "user", "content": [{"type": "image", "image": relative}, {"type": "text", "text": question}]},
        {"role": "assistant", "content": f"The square is {name}."},
    ]}


def days_sample(rng):
    i = rng.randrange(len(DAYS))
    day, following = DAYS[i], DAYS[(i + 1) % len(DAYS)]
    return {"messages": [
        {"role": "user", "content": f"Which day comes after {day}?"},
        {"role": "assistant", "content": f"{following} comes after {day}."},
    ]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=320)
    parser.add_argument("--val", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(os.path.join(args.out_dir, "images"), exist_ok=True)
    rng = random.Random(args.seed)
    index = 0
    for split, count in (("train", args.train), ("val", args.val)):
        with open(os.path.join(args.out_dir, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            for i in range(count):
                sample = colour_sample(rng, args.out_dir, index) if i % 2 == 0 else days_sample(rng)
                index += 1
                f.write(json.dumps(sample) + "\n")
    print(f"data: {args.train} train + {args.val} val samples (half with images) -> {args.out_dir}")


if __name__ == "__main__":
    main()
