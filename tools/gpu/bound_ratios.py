#!/usr/bin/env python3
"""Worst error / bound per case of gpu_text_model_gpu_test logs, over one or many weight draws.

The test prints, per case (a line without indentation), each tensor's rel_l2 and bound in its
whole-model section and per decoder layer alone. Given logs of runs with other
DELTAMOE_TEST_WEIGHT_SEED values, this prints per case and section the worst rel_l2 / bound over
all logs, with the tensor and log it came from: how close each bound comes to failing, the figure
the bounds' scales are calibrated on (gpu_text_model_gpu_test.cc, kSingleTokenBoundScale).
Usage: bound_ratios.py LOG...
"""
import re
import sys

LINE = re.compile(r"^\s+(\S.*?)\s+max\|diff\|.*rel_l2 ([0-9.e+-]+) \(bf16-weight sensitivity [0-9.e+-]+, bound ([0-9.e+-]+)\)")


def worst_ratios(paths):
    worst = {}  # (case, section) -> (ratio, tensor, path)
    for path in paths:
        case, section = None, None
        with open(path, errors="replace") as log:
            for raw in log:
                line = raw.rstrip("\n")
                if line and not line[0].isspace() and not line.startswith(("[", "gpu text model", "../", "Expected",
                                                                          "Running", "Note:", "model.")):
                    case, section = line, "whole model"
                    continue
                if line.startswith("  layer ") and "alone" in line:
                    section = "layers alone"
                    continue
                match = LINE.match(line)
                if match and case is not None:
                    rel, bound = float(match.group(2)), float(match.group(3))
                    ratio = rel / bound if bound > 0 else float("inf")
                    key = (case, section)
                    if key not in worst or ratio > worst[key][0]:
                        worst[key] = (ratio, match.group(1), path)
    return worst


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for (case, section), (ratio, tensor, path) in sorted(worst_ratios(sys.argv[1:]).items()):
        print(f"{ratio:6.3f}  {case} / {section}: {tensor} ({path})")


if __name__ == "__main__":
    main()
