#!/usr/bin/env python3
"""Generates a chat JSONL of image + text samples for throughput runs at full widths: each sample has
a PNG of one of the given sizes (a coloured square on a grey canvas), a question and a longer
answer; or, with --text_only, long text-only samples. Deterministic for a seed; PNGs are written
with zlib only and built row by row (fast enough for thousands of large images).

--fill_tokens N sizes each image sample's answer so that the sample is about N tokens long (its image
tokens, one per 32x32 pixels after the 2x2 merge of 16-pixel patches, plus the template and the
words, about one token each), so packing puts the images and text in the proportions that
`deltamoe bench --seqs S --images ...` uses for sequences of N tokens.

usage: make_vlm_dataset.py OUT_DIR --samples N [--image_sizes 512x512,640x480] [--text_only]
                           [--answer_words W | --fill_tokens N] [--seed S]
"""
import argparse
import json
import os
import random
import struct
import zlib

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (30, 60, 220), "yellow": (235, 215, 40),
           "purple": (140, 50, 170), "orange": (245, 140, 20)}
WORDS = ("the model reads the image and answers with a short description of what it sees in the picture "
         "including the colour of the square its place on the canvas and the size of the canvas itself").split()


def png(width, height, square, colour):
    """An RGB PNG: grey canvas, one coloured square (x0, y0, side)."""
    x0, y0, side = square
    grey = bytes((128, 128, 128))
    plain = b"\x00" + grey * width
    marked = b"\x00" + grey * x0 + bytes(colour) * side + grey * (width - x0 - side)
    rows = b"".join(marked if y0 <= y < y0 + side else plain for y in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 6)) + chunk(b"IEND", b"")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--image_sizes", default="512x512,640x480,768x576,480x640")
    parser.add_argument("--text_only", action="store_true")
    parser.add_argument("--answer_words", type=int, default=24)
    parser.add_argument("--fill_tokens", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.image_sizes.split(",")]
    os.makedirs(os.path.join(args.out_dir, "images"), exist_ok=True)
    lines = []
    # Tokens of an image sample besides its image tokens and answer words: the chat template's
    # markers, the question and "The square is <colour>." (measured with the Qwen3 tokenizer).
    template_tokens = 28
    for i in range(args.samples):
        width, height = sizes[i % len(sizes)]
        words = args.answer_words
        if args.fill_tokens and not args.text_only:
            words = max(1, args.fill_tokens - (width // 32) * (height // 32) - template_tokens)
        answer = " ".join(rng.choice(WORDS) for _ in range(words))
        if args.text_only:
            question = " ".join(rng.choice(WORDS) for _ in range(args.answer_words // 4))
            lines.append({"messages": [{"role": "user", "content": question},
                                       {"role": "assistant", "content": answer}]})
            continue
        name = rng.choice(sorted(COLOURS))
        side = rng.randint(min(width, height) // 8, min(width, height) // 3)
        square = (rng.randint(0, width - side), rng.randint(0, height - side), side)
        path = os.path.join("images", f"{i:06d}.png")
        with open(os.path.join(args.out_dir, path), "wb") as f:
            f.write(png(width, height, square, COLOURS[name]))
        lines.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": path},
                                         {"type": "text", "text": "Describe the square in this picture."}]},
            {"role": "assistant", "content": f"The square is {name}. {answer}"}]})
    with open(os.path.join(args.out_dir, "train.jsonl"), "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    print(f"{args.samples} samples -> {args.out_dir}/train.jsonl")


if __name__ == "__main__":
    main()
