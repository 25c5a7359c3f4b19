"""Runs the transformers anchor (../shared/tools/hf_anchor.py, the copy carried in .anchors_src/)
with the model's cache off (config.use_cache = False), so that it builds models of fewer than four
layers too: with the cache on, transformers 5.17 fails on a model whose layers are all linear
attention (DynamicCache.get_seq_length needs an attention layer). A training step never reads the
cache, so the step it times does the same work. layer_anchor.sh runs the anchor through this at
both depths, so the two depths it subtracts are timed alike.
  HF_ANCHOR: another path to hf_anchor.py. Arguments pass through unchanged."""
import os
import sys

path = os.path.abspath(os.environ.get("HF_ANCHOR", ".anchors_src/hf_anchor.py"))
with open(path) as handle:
    source = handle.read()
marker = '    cfg._attn_implementation = "sdpa"\n'
if source.count(marker) != 1:
    sys.exit(f"hf_anchor_no_cache: {path} does not set the config where expected "
             f"(one line '{marker.strip()}'); update this wrapper")
source = source.replace(marker, marker + "    cfg.use_cache = False\n")
sys.argv[0] = path
exec(compile(source, path, "exec"), {"__name__": "__main__", "__file__": path})
