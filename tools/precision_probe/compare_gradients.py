#!/usr/bin/env python3
"""Scores every gradient of a parity output against a golden case's expected.safetensors the way
the parity checks do (||got - ref|| / ||ref|| per tensor), in plain python3 (f32 tensors only).

usage: compare_gradients.py EXPECTED GOT [TOP]
Prints the worst tensor, the FOCUS tensor's score (environment; default: the aux-loss gradient of
layer 0's GDN in_proj_b) and the median over tensors, then the TOP worst (default 6)."""
import array
import json
import math
import os
import statistics
import struct
import sys


def load_f32(path):
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
        data = f.read()
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] != "F32":
            continue
        begin, end = info["data_offsets"]
        values = array.array("f")
        values.frombytes(data[begin:end])
        tensors[name] = values
    return tensors


def main():
    ref, got = load_f32(sys.argv[1]), load_f32(sys.argv[2])
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    focus = os.environ.get("FOCUS", "grad_aux.model.language_model.layers.0.linear_attn.in_proj_b.weight")
    scores = {}
    for name, r in ref.items():
        if not name.startswith("grad") or name not in got:
            continue
        diff = math.sqrt(sum((a - b) ** 2 for a, b in zip(got[name], r)))
        norm = math.sqrt(sum(b * b for b in r))
        scores[name] = diff / norm if norm else 0.0
    ranked = sorted(scores.items(), key=lambda item: -item[1])
    print("worst %.3e %s | focus %.3e | median %.3e" % (ranked[0][1], ranked[0][0], scores.get(focus, -1.0),
                                                         statistics.median(scores.values())))
    for name, score in ranked[:top]:
        print("   %.3e %s" % (score, name))


if __name__ == "__main__":
    main()
