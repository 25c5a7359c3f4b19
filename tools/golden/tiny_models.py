# Tiny random Qwen3.5-MoE models for golden files: configs, construction with the plain
# (eager / torch-fallback) backends, a deliberately large re-initialisation, and the
# router-margin check that keeps expert selection stable across fp32 reimplementations.
import importlib
import importlib.util
import math

import torch

# Token ids of the tiny VLM vocabulary (all below the 512-row vocabulary).
kImageTokenId = 500
kVideoTokenId = 501
kVisionStartTokenId = 502
kVisionEndTokenId = 503
kTextTokenLimit = 496  # random text tokens are drawn from [0, kTextTokenLimit)

# Router logits are ~N(0, kRouterGain^2) after the re-init; a wide spread keeps the gap between
# the k-th and (k+1)-th expert large compared with fp32 rounding noise.
kRouterGain = 3.0
# Smallest accepted gap between the k-th and (k+1)-th router logit of any token in any layer.
kMinRouterLogitGap = 5e-4


class GoldenError(RuntimeError):
    """A self-check failed; the message says what and where."""


def _import_class(name):
    """Finds a transformers class at the top level, else in the qwen3_5_moe package."""
    transformers = importlib.import_module("transformers")
    if hasattr(transformers, name):
        return getattr(transformers, name)
    for module_name in (
        "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
        "transformers.models.qwen3_5_moe.configuration_qwen3_5_moe",
    ):
        module = importlib.import_module(module_name)
        if hasattr(module, name):
            return getattr(module, name)
    raise GoldenError(f"transformers {transformers.__version__} has no class {name}")


kFastKernelPackages = ("fla", "causal_conv1d")


def block_fast_kernels():
    """Hides flash-linear-attention and causal-conv1d from this process (call before importing
    transformers): a None entry in sys.modules makes find_spec() report the package as absent and
    any import of it fail loudly, so transformers falls back to its torch code."""
    import sys

    installed = [pkg for pkg in kFastKernelPackages if importlib.util.find_spec(pkg) is not None]
    for pkg in kFastKernelPackages:
        sys.modules[pkg] = None
    return installed


def check_no_fast_kernels():
    """The golden numbers must come from transformers' torch fallbacks, not FLA/causal-conv1d."""
    present = [pkg for pkg in kFastKernelPackages if importlib.util.find_spec(pkg) is not None]
    if present:
        raise GoldenError(
            f"packages {present} are importable; transformers would use their kernels instead of the "
            "torch fallback for Gated DeltaNet. Run in an environment without them."
        )


def text_config_dict(num_layers, moe_intermediate, shared_intermediate, layer_types=None, hidden_size=40):
    """Keyword arguments of Qwen3_5MoeTextConfig for a tiny text tower."""
    if layer_types is None:
        layer_types = [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)
        ]
    return dict(
        vocab_size=512,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        layer_types=list(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        attention_bias=False,
        attention_dropout=0.0,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10000.0,
            partial_rotary_factor=0.25,
            mrope_section=[2, 1, 1],
            mrope_interleaved=True,
        ),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=moe_intermediate,
        shared_expert_intermediate_size=shared_intermediate,
        router_aux_loss_coef=0.001,
        output_router_logits=True,
        tie_word_embeddings=False,
        use_cache=False,
    )


def vision_config_dict(out_hidden_size):
    """Keyword arguments of Qwen3_5MoeVisionConfig for a tiny ViT (real patch geometry)."""
    return dict(
        depth=2,
        hidden_size=16,
        hidden_act="gelu_pytorch_tanh",
        intermediate_size=32,
        num_heads=2,
        in_channels=3,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=out_hidden_size,
        num_position_embeddings=16,  # a 4x4 learned grid, resampled bilinearly per image
    )


def _check_rope(text_config):
    """Older releases kept rope keys at the top level; make sure the tiny values took effect."""
    rope = getattr(text_config, "rope_parameters", None)
    if isinstance(rope, dict):
        wanted = dict(partial_rotary_factor=0.25, mrope_section=[2, 1, 1], rope_theta=10000.0)
        for key, value in wanted.items():
            if key not in rope:
                rope[key] = value
            if rope[key] != value and not (isinstance(value, list) and list(rope[key]) == value):
                raise GoldenError(f"rope_parameters[{key!r}] is {rope[key]!r}, expected {value!r}")
    else:
        text_config.rope_theta = 10000.0
        text_config.partial_rotary_factor = 0.25
        text_config.rope_scaling = dict(rope_type="default", mrope_section=[2, 1, 1], mrope_interleaved=True)


def build_text_config(**kwargs):
    config = _import_class("Qwen3_5MoeTextConfig")(**text_config_dict(**kwargs))
    _check_rope(config)
    return config


def build_vlm_config(**text_kwargs):
    text = text_config_dict(**text_kwargs)
    config = _import_class("Qwen3_5MoeConfig")(
        text_config=text,
        vision_config=vision_config_dict(out_hidden_size=text["hidden_size"]),
        image_token_id=kImageTokenId,
        video_token_id=kVideoTokenId,
        vision_start_token_id=kVisionStartTokenId,
        vision_end_token_id=kVisionEndTokenId,
        tie_word_embeddings=False,
    )
    _check_rope(config.text_config)
    return config


def select_plain_backends(model):
    """Eager attention and eager (loop over experts) MoE: the most literal reference code."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    else:
        model.config._attn_implementation = "eager"
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    elif hasattr(model.config, "_experts_implementation"):
        model.config._experts_implementation = "eager"
    attn = getattr(model.config, "_attn_implementation", None)
    if attn not in (None, "eager"):
        raise GoldenError(f"attention implementation is {attn!r}, wanted 'eager'")


def backend_summary(model):
    summary = {"attn_implementation": getattr(model.config, "_attn_implementation", None)}
    if hasattr(model, "get_experts_implementation"):
        try:
            summary["experts_implementation"] = model.get_experts_implementation()
        except Exception as error:  # informational only
            summary["experts_implementation"] = f"unknown ({error})"
    return summary


def build_model(class_name, config, seed, matrix_gain=1.0):
    """Constructs the model in fp32 on the CPU and replaces every parameter (see reinitialise)."""
    torch.manual_seed(seed)
    model = _import_class(class_name)(config).to(dtype=torch.float32, device="cpu")
    select_plain_backends(model)
    if model.get_input_embeddings().weight is model.get_output_embeddings().weight:
        raise GoldenError("lm_head is tied to embed_tokens although tie_word_embeddings=False")
    reinitialise(model, seed, matrix_gain)
    wrong = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if wrong:
        raise GoldenError(f"parameters not in float32: {wrong[:5]}")
    model.eval()  # no dropout anywhere; gradients still flow
    return model


def _fan_in(name, shape):
    if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
        return shape[-1]  # [E, out, in]
    return math.prod(shape[1:])  # Linear [out, in], Conv1d [C, 1, K], Conv3d [C, 3, T, P, P]


def reinitialise(model, seed, matrix_gain=1.0):
    """Weights much larger than the default 0.02 init, so routing is decisive and every
    nonlinearity (SiLU, gates, decays, norms) works away from its linear regime. matrix_gain
    scales the weight matrices (not embeddings, lm_head or routers): at 1 the tiny model is close
    to chaotic (one bf16 rounding of the weights moves most gradients by 2-25%, measured by
    parity_bf16_sensitivity_test), at 0.3 by ~0.5% (median)."""
    generator = torch.Generator().manual_seed(seed * 7919 + 17)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=generator, dtype=torch.float32) * std + mean

    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            in_vision = ".visual." in f".{name}"
            if name.endswith("A_log"):
                # decay rates exp(A_log) in [0.05, 1]: per-step decays of roughly 0.3-0.97
                value = torch.empty(shape).uniform_(0.05, 1.0, generator=generator).log()
            elif name.endswith("dt_bias"):
                value = normal(shape, 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                value = normal(shape, 0.1, mean=1.0)  # plain (not zero-centred) gated RMSNorm
            elif len(shape) == 1 and in_vision and name.endswith("weight"):
                value = normal(shape, 0.1, mean=1.0)  # vision LayerNorm scales
            elif len(shape) == 1 and name.endswith("bias"):
                value = normal(shape, 0.1)
            elif len(shape) == 1:
                value = normal(shape, 0.1)  # zero-centred RMSNorm weights, used as (1 + w)
            elif name.endswith("embed_tokens.weight") or name.endswith("pos_embed.weight"):
                value = normal(shape, 1.0)
            elif name.endswith("mlp.gate.weight"):
                value = normal(shape, kRouterGain / math.sqrt(shape[-1]))
            else:
                gain = 1.0 if name.endswith("lm_head.weight") else matrix_gain
                value = normal(shape, gain / math.sqrt(_fan_in(name, shape)))
            param.copy_(value)


def router_margins(router_logits, top_k):
    """Smallest gap between the k-th and (k+1)-th logit, and between the probabilities, over
    all layers and tokens."""
    if not router_logits:
        raise GoldenError("the model returned no router_logits (output_router_logits ignored?)")
    min_logit_gap = math.inf
    min_prob_gap = math.inf
    for layer_logits in router_logits:
        logits = layer_logits.detach().float().reshape(-1, layer_logits.shape[-1])
        sorted_logits = logits.sort(dim=-1, descending=True).values
        probs = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True).values
        min_logit_gap = min(min_logit_gap, (sorted_logits[:, top_k - 1] - sorted_logits[:, top_k]).min().item())
        min_prob_gap = min(min_prob_gap, (probs[:, top_k - 1] - probs[:, top_k]).min().item())
    return min_logit_gap, min_prob_gap
