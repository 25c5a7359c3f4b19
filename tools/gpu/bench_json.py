"""The BENCH_JSON record that `deltamoe bench` (and tools/bench_hf.py) prints, read back from a log.

Imported by the summaries of tools/gpu/layer_anchor.sh and tools/gpu/bench_ab.sh (not run)."""
import json


def read_bench_json(path):
    """The log's first BENCH_JSON record as a dict, or None when the file or the record is missing."""
    try:
        with open(path) as log:
            for line in log:
                if line.startswith("BENCH_JSON "):
                    return json.loads(line[len("BENCH_JSON "):])
    except OSError:
        pass
    return None
