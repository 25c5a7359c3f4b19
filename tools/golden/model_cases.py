# Golden model cases: builds each tiny model and its inputs, runs transformers forward and
# backward in fp32 on the CPU, checks the numbers, and writes model/, inputs, expected, case.json.
import json
import math
import os

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

import router_margins as rm
import tiny_models as tm

kIgnoreIndex = -100
kMaxSeedAttempts = 40  # re-draws until router margins are comfortable
# The *_router_margin cases (well-conditioned for bf16, so the GPU can be held to the issue's
# bounds against these files): matrices at 0.3 of the usual gain, and every token's k-th vs
# (k+1)-th router logit at least kBf16RouterLogitGap apart. Router logits have std ~kRouterGain (3);
# the GPU's router inputs differ from fp32 by ~1e-2 relative, i.e. ~0.03 in a logit, so 0.3 leaves
# 10x. (A probability threshold would say less: the k-th and (k+1)-th probabilities can both be
# small while their logits are far apart.)
kWellConditionedMatrixGain = 0.3
kBf16RouterLogitGap = 0.3


class ModelCase:
    """One golden case: which model, which inputs."""

    def __init__(self, name, description, kind, config_kwargs, make_inputs, seed, matrix_gain=1.0,
                 min_router_logit_gap=None):
        self.name = name
        self.description = description
        self.kind = kind  # "text" or "vlm"
        self.config_kwargs = config_kwargs
        self.make_inputs = make_inputs  # (generator) -> dict of tensors
        self.seed = seed
        self.matrix_gain = matrix_gain  # tiny_models.reinitialise
        # None: re-draw seeds until the fp32 margin check passes; else widen the routers' margins
        # to this logit gap (router_margins.py) and refuse the case if any layer stays under it.
        self.min_router_logit_gap = min_router_logit_gap


# ---------------------------------------------------------------- inputs

def _random_text(generator, length):
    return torch.randint(0, tm.kTextTokenLimit, (length,), generator=generator, dtype=torch.int64)


def _labels_from_ids(input_ids, unsupervised_mask):
    labels = input_ids.clone()
    labels[unsupervised_mask] = kIgnoreIndex
    return labels


def text_inputs(batch, seq, prompt_lengths):
    """Random tokens; the first prompt_lengths[b] labels of row b are -100 (unsupervised)."""

    def make(generator):
        input_ids = torch.stack([_random_text(generator, seq) for _ in range(batch)])
        mask = torch.zeros(batch, seq, dtype=torch.bool)
        for row, length in enumerate(prompt_lengths):
            mask[row, :length] = True
        return {"input_ids": input_ids, "labels": _labels_from_ids(input_ids, mask)}

    return make


def vlm_inputs(rows):
    """rows: one list per batch row of segments ("text", n) / ("image", (t, h, w)) /
    ("vs",) / ("ve",). Image tokens get mm_token_type_ids 1 and label -100, and so do the
    vision start/end markers' labels; the first text segment of each row is the prompt."""

    def make(generator):
        ids_rows, type_rows, mask_rows, grids = [], [], [], []
        for segments in rows:
            ids, types, unsup = [], [], []
            first_text = True
            for segment in segments:
                kind = segment[0]
                if kind == "text":
                    tokens = _random_text(generator, segment[1]).tolist()
                    ids += tokens
                    types += [0] * len(tokens)
                    unsup += [first_text] * len(tokens)
                    first_text = False
                elif kind in ("vs", "ve"):
                    ids.append(tm.kVisionStartTokenId if kind == "vs" else tm.kVisionEndTokenId)
                    types.append(0)
                    unsup.append(True)
                elif kind == "image":
                    t, h, w = segment[1]
                    count = t * h * w // 4
                    ids += [tm.kImageTokenId] * count
                    types += [1] * count
                    unsup += [True] * count
                    grids.append([t, h, w])
                else:
                    raise tm.GoldenError(f"unknown segment kind {kind!r}")
            ids_rows.append(ids)
            type_rows.append(types)
            mask_rows.append(unsup)
        lengths = {len(r) for r in ids_rows}
        if len(lengths) != 1:
            raise tm.GoldenError(f"VLM rows must have equal length (no padding), got {sorted(lengths)}")
        input_ids = torch.tensor(ids_rows, dtype=torch.int64)
        grid = torch.tensor(grids, dtype=torch.int64)
        num_patches = int(grid.prod(dim=-1).sum())
        # Values in the range of normalised pixels ((x/255 - 0.5) / 0.5 lies in [-1, 1]).
        pixel_values = torch.rand(num_patches, 3 * 2 * 16 * 16, generator=generator) * 2 - 1
        return {
            "input_ids": input_ids,
            "labels": _labels_from_ids(input_ids, torch.tensor(mask_rows)),
            "pixel_values": pixel_values,
            "image_grid_thw": grid,
            "mm_token_type_ids": torch.tensor(type_rows, dtype=torch.int64),
        }

    return make


def all_cases():
    base = dict(num_layers=4, moe_intermediate=32, shared_intermediate=24)
    narrow4 = dict(num_layers=4, moe_intermediate=16, shared_intermediate=16)
    narrow8 = dict(num_layers=8, moe_intermediate=16, shared_intermediate=16)
    vlm = dict(num_layers=2, moe_intermediate=16, shared_intermediate=16,
               layer_types=["linear_attention", "full_attention"])
    return [
        ModelCase("text_two_rows", "4 layers [lin,lin,lin,full], B=2, S=37, prompt labels -100 "
                  "(5 tokens in row 0, 11 in row 1)", "text", base, text_inputs(2, 37, [5, 11]), 1001),
        ModelCase("text_long", "4 layers [lin,lin,lin,full], B=1, S=200 (four 64-token GDN chunks, "
                  "last one partial), first 20 labels -100", "text", narrow4, text_inputs(1, 200, [20]), 1002),
        ModelCase("text_8layer", "8 layers [lin,lin,lin,full]x2, B=1, S=48, first 8 labels -100",
                  "text", narrow8, text_inputs(1, 48, [8]), 1003),
        ModelCase("vlm_two_images", "VLM, 2 text layers [lin,full]; one sample with two images of "
                  "different grids (1,4,6) and (1,6,2), text before, between and after",
                  "vlm", vlm,
                  vlm_inputs([[("text", 5), ("vs",), ("image", (1, 4, 6)), ("ve",), ("text", 4),
                               ("vs",), ("image", (1, 6, 2)), ("ve",), ("text", 7)]]), 1004),
        ModelCase("vlm_image_first", "VLM, 2 text layers [lin,full]; B=2: row 0 starts with an image "
                  "(grid (1,4,4), no vision_start before it), then a 5-token prompt and 10 supervised "
                  "tokens; row 1 has text then an image of grid (1,2,6); images fill placeholders in "
                  "row-major order",
                  "vlm", vlm,
                  vlm_inputs([[("image", (1, 4, 4)), ("ve",), ("text", 5), ("text", 10)],
                              [("text", 6), ("vs",), ("image", (1, 2, 6)), ("ve",), ("text", 9)]]),
                  1005),
        # Well-conditioned twins of text_two_rows and vlm_two_images (same shapes and inputs).
        ModelCase("text_router_margin", "text_two_rows' shapes and inputs; matrices at gain "
                  f"{kWellConditionedMatrixGain}, router logit gaps >= {kBf16RouterLogitGap} for every "
                  "token and layer (well-conditioned for bf16)", "text", base, text_inputs(2, 37, [5, 11]),
                  1006, kWellConditionedMatrixGain, kBf16RouterLogitGap),
        ModelCase("vlm_router_margin", "vlm_two_images' shapes and inputs; matrices at gain "
                  f"{kWellConditionedMatrixGain}, router logit gaps >= {kBf16RouterLogitGap} for every "
                  "token and layer (well-conditioned for bf16)", "vlm", vlm,
                  vlm_inputs([[("text", 5), ("vs",), ("image", (1, 4, 6)), ("ve",), ("text", 4),
                               ("vs",), ("image", (1, 6, 2)), ("ve",), ("text", 7)]]),
                  1007, kWellConditionedMatrixGain, kBf16RouterLogitGap),
        # Matrices at smaller gains: measured fit for the 2e-2 bar by bf16_floor.py (transformers'
        # autocast run within it; docs/vision.md). Tried and not kept: text at gain 0.1 and hidden 64
        # at 0.15 (autocast 3.9e-2 / 5.2e-2), longer or wider cases at 0.3.
        ModelCase("text_gain015_router_margin", "text_two_rows' shapes and inputs; matrices at gain 0.15, "
                  f"router logit gaps >= {kBf16RouterLogitGap}", "text", base, text_inputs(2, 37, [5, 11]),
                  1011, 0.15, kBf16RouterLogitGap),
        ModelCase("vlm_gain015_router_margin", "vlm_two_images' shapes and inputs; matrices at gain 0.15, "
                  f"router logit gaps >= {kBf16RouterLogitGap}", "vlm", vlm,
                  vlm_inputs([[("text", 5), ("vs",), ("image", (1, 4, 6)), ("ve",), ("text", 4),
                               ("vs",), ("image", (1, 6, 2)), ("ve",), ("text", 7)]]),
                  1014, 0.15, kBf16RouterLogitGap),
        ModelCase("vlm_gain010_router_margin", "vlm_two_images' shapes and inputs; matrices at gain 0.1, "
                  f"router logit gaps >= {kBf16RouterLogitGap}", "vlm", vlm,
                  vlm_inputs([[("text", 5), ("vs",), ("image", (1, 4, 6)), ("ve",), ("text", 4),
                               ("vs",), ("image", (1, 6, 2)), ("ve",), ("text", 7)]]),
                  1015, 0.1, kBf16RouterLogitGap),
    ]


# ---------------------------------------------------------------- running

def _forward(model, inputs, labels=True):
    kwargs = dict(input_ids=inputs["input_ids"], use_cache=False, output_router_logits=True)
    if labels:
        kwargs["labels"] = inputs["labels"]
    for key in ("pixel_values", "image_grid_thw", "mm_token_type_ids"):
        if key in inputs:
            kwargs[key] = inputs[key]
    return model(**kwargs)


def causal_lm_ce(logits, labels):
    """transformers' ForCausalLMLoss semantics: fp32 logits, labels padded with -100 on the
    right and shifted left by one, mean over the non-ignored positions."""
    shifted = F.pad(labels, (0, 1), value=kIgnoreIndex)[..., 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                           ignore_index=kIgnoreIndex, reduction="mean")


def _text_config(model):
    return getattr(model.config, "text_config", model.config)


def build_margin_model(case, class_name, log):
    """One draw; the routers are nudged until every gap reaches case.min_router_logit_gap, which is
    then measured again per layer; returns (model, inputs, seed, margins) or refuses the case."""
    config = (tm.build_text_config(**case.config_kwargs) if case.kind == "text"
              else tm.build_vlm_config(**case.config_kwargs))
    model = tm.build_model(class_name, config, case.seed, case.matrix_gain)
    inputs = case.make_inputs(torch.Generator().manual_seed(case.seed))
    top_k = _text_config(model).num_experts_per_tok
    forward = lambda: _forward(model, inputs, labels=False)  # noqa: E731
    rm.widen_router_margins(model, forward, top_k, case.min_router_logit_gap, log)
    margins = rm.layer_margins(model, forward, top_k)
    for layer, (logit_gap, prob_gap) in enumerate(margins):
        log(f"  layer {layer}: smallest router gap k-th vs (k+1)-th: logit {logit_gap:.3e}, prob {prob_gap:.3e}")
    short = [layer for layer, (logit_gap, _) in enumerate(margins) if logit_gap < case.min_router_logit_gap]
    if short:
        raise tm.GoldenError(f"{case.name}: layers {short} have a router logit gap under "
                             f"{case.min_router_logit_gap} after widening; the case would not be "
                             "well-conditioned for bf16")
    logit_gap = min(gap for gap, _ in margins)
    prob_gap = min(gap for _, gap in margins)
    return model, inputs, case.seed, (logit_gap, prob_gap)


def build_checked_model(case, log):
    """Draws seeds until the router margins are comfortable; returns (model, inputs, seed, margins)."""
    class_name = "Qwen3_5MoeForCausalLM" if case.kind == "text" else "Qwen3_5MoeForConditionalGeneration"
    if case.min_router_logit_gap is not None:
        return build_margin_model(case, class_name, log)
    for attempt in range(kMaxSeedAttempts):
        seed = case.seed + 100000 * attempt
        config = (tm.build_text_config(**case.config_kwargs) if case.kind == "text"
                  else tm.build_vlm_config(**case.config_kwargs))
        model = tm.build_model(class_name, config, seed, case.matrix_gain)
        inputs = case.make_inputs(torch.Generator().manual_seed(seed))
        with torch.no_grad():
            outputs = _forward(model, inputs, labels=False)
        logit_gap, prob_gap = tm.router_margins(outputs.router_logits, _text_config(model).num_experts_per_tok)
        log(f"  seed {seed}: min router gap k-th vs (k+1)-th: logit {logit_gap:.3e}, prob {prob_gap:.3e}")
        if logit_gap >= tm.kMinRouterLogitGap:
            return model, inputs, seed, (logit_gap, prob_gap)
    raise tm.GoldenError(f"{case.name}: no seed in {kMaxSeedAttempts} attempts gave a router logit gap "
                         f">= {tm.kMinRouterLogitGap}")


def _check_finite(name, tensor):
    if not torch.isfinite(tensor).all():
        raise tm.GoldenError(f"{name} has non-finite values")


def compute_expected(model, inputs, log):
    outputs = _forward(model, inputs)
    logits = outputs.logits
    text_config = _text_config(model)
    if outputs.aux_loss is None or outputs.loss is None:
        raise tm.GoldenError("the model returned no loss or no aux_loss")
    ce = causal_lm_ce(logits, inputs["labels"])
    aux = outputs.aux_loss
    coef = text_config.router_aux_loss_coef
    recombined = ce + coef * aux
    mismatch = abs(recombined.item() - outputs.loss.item())
    log(f"  ce_loss {ce.item():.6f}  aux_loss {aux.item():.6f}  coef {coef}  "
        f"|ce + coef*aux - loss| = {mismatch:.2e}")
    if mismatch > 1e-5 * max(1.0, abs(outputs.loss.item())):
        raise tm.GoldenError(f"own CE {ce.item()} + {coef}*aux {aux.item()} != transformers loss "
                             f"{outputs.loss.item()}")
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    grads_ce = torch.autograd.grad(ce, params, retain_graph=True, allow_unused=True)
    grads_aux = torch.autograd.grad(aux, params, allow_unused=True)
    expected = {"ce_loss": ce.detach().float().reshape(()), "aux_loss": aux.detach().float().reshape(()),
                "logits": logits.detach().float().contiguous()}
    for name, param, g_ce, g_aux in zip(names, params, grads_ce, grads_aux):
        g_ce = torch.zeros_like(param) if g_ce is None else g_ce
        g_aux = torch.zeros_like(param) if g_aux is None else g_aux
        expected[f"grad.{name}"] = g_ce.detach().float().contiguous()
        expected[f"grad_aux.{name}"] = g_aux.detach().float().contiguous()
    for key, value in expected.items():
        _check_finite(key, value)
    return expected, outputs


def _group_of(name):
    for marker in ("visual.", "embed_tokens", "lm_head", "linear_attn", "self_attn", "mlp.gate.",
                   "mlp.experts", "mlp.shared_expert", "norm"):
        if marker in name:
            return marker.strip(".")
    return "other"


def log_grad_groups(expected, log):
    groups = {}
    for key, value in expected.items():
        for prefix in ("grad.", "grad_aux."):
            if key.startswith(prefix):
                group = (prefix[:-1], _group_of(key[len(prefix):]))
                groups[group] = max(groups.get(group, 0.0), value.abs().max().item())
    for (kind, group), value in sorted(groups.items()):
        log(f"    max|{kind}| {group:18s} {value:.3e}")
    if all(v == 0.0 for (kind, _), v in groups.items() if kind == "grad"):
        raise tm.GoldenError("every CE gradient is zero")
    if all(v == 0.0 for (kind, _), v in groups.items() if kind == "grad_aux"):
        raise tm.GoldenError("every aux gradient is zero")


def _load_class(model):
    return type(model)


def save_and_verify(model, inputs, model_dir, log):
    """save_pretrained, then reload and check identical parameters and logits."""
    try:
        model.save_pretrained(model_dir, safe_serialization=True)
    except TypeError:  # newer releases always write safetensors and dropped the flag
        model.save_pretrained(model_dir)
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files or not os.path.exists(os.path.join(model_dir, "config.json")):
        raise tm.GoldenError(f"{model_dir}: save_pretrained wrote no config.json/safetensors")
    disk_keys = []
    for file in files:
        with safe_open(os.path.join(model_dir, file), framework="pt") as handle:
            disk_keys += list(handle.keys())
    try:
        reloaded = _load_class(model).from_pretrained(model_dir, dtype=torch.float32)
    except TypeError:
        reloaded = _load_class(model).from_pretrained(model_dir, torch_dtype=torch.float32)
    tm.select_plain_backends(reloaded)
    reloaded.eval()
    original = dict(model.named_parameters())
    loaded = dict(reloaded.named_parameters())
    if set(original) != set(loaded):
        raise tm.GoldenError(f"reload changed parameter names: missing {sorted(set(original) - set(loaded))[:5]}, "
                             f"extra {sorted(set(loaded) - set(original))[:5]}")
    for name, value in original.items():
        if not torch.equal(value.detach(), loaded[name].detach()):
            diff = (value.detach() - loaded[name].detach()).abs().max().item()
            raise tm.GoldenError(f"reloaded parameter {name} differs (max abs {diff:.3e})")
    with torch.no_grad():
        a = _forward(model, inputs, labels=False).logits
        b = _forward(reloaded, inputs, labels=False).logits
    diff = (a - b).abs().max().item()
    log(f"  reload check: {len(disk_keys)} tensors on disk in {files}, params identical, "
        f"logits max abs diff {diff:.2e}")
    if diff > 1e-6:
        raise tm.GoldenError(f"reloaded model gives different logits (max abs diff {diff:.3e})")
    return disk_keys


def _expert_layout(disk_keys):
    if any(".mlp.experts.gate_up_proj" in k for k in disk_keys):
        return "fused"
    if any(".mlp.experts.0.gate_proj.weight" in k for k in disk_keys):
        return "per_expert"
    return "unknown"


def _mrope_positions(model, inputs):
    """3-D rope positions from transformers' own get_rope_index (stored for debugging)."""
    inner = getattr(model, "model", None)
    if not hasattr(inner, "get_rope_index"):
        return None
    try:
        position_ids, _ = inner.get_rope_index(
            inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
            image_grid_thw=inputs["image_grid_thw"])
    except TypeError as error:  # another signature in this release: the positions are optional
        print(f"  note: get_rope_index not called ({error})")
        return None
    return position_ids


def _file_size(path):
    return os.path.getsize(path)


def run_model_case(case, out_dir, versions, log):
    log(f"== case {case.name}: {case.description}")
    case_dir = os.path.join(out_dir, case.name)
    os.makedirs(case_dir, exist_ok=True)
    model, inputs, seed, (logit_gap, prob_gap) = build_checked_model(case, log)
    for key, value in inputs.items():
        log(f"  input {key:18s} {str(value.dtype):12s} {list(value.shape)}")
    expected, outputs = compute_expected(model, inputs, log)
    log(f"  logits {list(expected['logits'].shape)}, {sum(k.startswith('grad.') for k in expected)} "
        f"parameter tensors")
    log_grad_groups(expected, log)
    if case.kind == "vlm":
        positions = _mrope_positions(model, inputs)
        if positions is not None:
            expected["mrope_position_ids"] = positions.float().contiguous()
            log(f"  mrope positions (t,h,w) of row 0: {positions[:, 0].tolist()}")
    disk_keys = save_and_verify(model, inputs, os.path.join(case_dir, "model"), log)
    save_file({k: v.contiguous() for k, v in inputs.items()}, os.path.join(case_dir, "inputs.safetensors"))
    save_file(expected, os.path.join(case_dir, "expected.safetensors"))
    info = {
        "description": case.description,
        "class": type(model).__name__,
        "seed": seed,
        "router_min_logit_gap": logit_gap,
        "router_min_prob_gap": prob_gap,
        "matrix_gain": case.matrix_gain,
        "required_router_logit_gap": case.min_router_logit_gap,
        "ce_loss": expected["ce_loss"].item(),
        "aux_loss": expected["aux_loss"].item(),
        "router_aux_loss_coef": _text_config(model).router_aux_loss_coef,
        "backends": tm.backend_summary(model),
        "checkpoint_expert_layout": _expert_layout(disk_keys),
        "checkpoint_keys": sorted(disk_keys),
        "notes": "expected.mrope_position_ids (VLM only) is transformers' get_rope_index output "
                 "[3,B,S] stored as f32; grads use the in-memory (fused) parameter names.",
        **versions,
    }
    with open(os.path.join(case_dir, "case.json"), "w") as handle:
        json.dump(info, handle, indent=1)
    total = 0
    for root, _, files in os.walk(case_dir):
        for file in files:
            total += _file_size(os.path.join(root, file))
    log(f"  wrote {case_dir} ({total / 1e6:.2f} MB), checkpoint expert layout "
        f"{info['checkpoint_expert_layout']}")
    if math.isnan(info["ce_loss"]):
        raise tm.GoldenError("ce_loss is NaN")
    return total
