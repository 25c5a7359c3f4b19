"""Vision tower anchor for issue 20: transformers' Qwen3.5-MoE vision tower (modeling_qwen3_5_moe,
random weights at the 35B-A3B vision config: 27 blocks, hidden 1,152, 16 heads of 72, MLP 4,304,
merger 4,608 -> 2,048; bf16 parameters, SDPA attention) forward and forward + backward on a batch of
images, CUDA-event medians. FLOPs are counted as gpu_vision_model_gpu_test's Timing case counts
ours: every Linear (2 N in out per product, the patch embedding's too), attention 4 S^2 C per image
forward, backward two products per Linear (the patch embedding only its weight's) and 2.5x the
attention. Run in the same call as `gpu_vision_model_gpu_test --gtest_filter='*Timing*'` so both
rows come from one run. Prints one `VISION_ANCHOR {...}` JSON line per batch."""
import json
import sys

import torch

from cuda_event_timing import median_ms

# The batches gpu_vision_model_gpu_test times: (t, h, w) patch grids per image.
BATCHES = {
    "8 x 448^2": [(1, 28, 28)] * 8,
    "mixed 4 (1024x768, 448^2, 640x480, 512^2)": [(1, 64, 48), (1, 28, 28), (1, 40, 30), (1, 32, 32)],
}
PEAK_TFLOPS = 989.0  # H200 dense bf16, spec sheet (the test's floor uses the same)


def vision_config():
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
    cfg = Qwen3_5MoeVisionConfig(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
                                 num_heads=16, in_channels=3, patch_size=16, temporal_patch_size=2,
                                 spatial_merge_size=2, out_hidden_size=2048, num_position_embeddings=2304)
    cfg._attn_implementation = "sdpa"
    return cfg


def tower_flops(cfg, grids):
    C, I, depth = cfg.hidden_size, cfg.intermediate_size, cfg.depth
    K = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    m2 = cfg.spatial_merge_size ** 2
    wide, O = C * m2, cfg.out_hidden_size
    N = sum(t * h * w for t, h, w in grids)
    M = N // m2
    squares = sum(t * (h * w) ** 2 for t, h, w in grids)  # attention runs per frame
    block_linear = 2.0 * N * C * (3 * C + C + 2 * I)
    block_attention = 4.0 * squares * C
    fwd = depth * (block_linear + block_attention) + 2.0 * N * K * C + 2.0 * M * wide * (wide + O)
    bwd = depth * (2 * block_linear + 2.5 * block_attention) + 2.0 * N * K * C + 2 * 2.0 * M * wide * (wide + O)
    return N, M, fwd, bwd


def main():
    import transformers
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel
    print("torch", torch.__version__, "transformers", transformers.__version__, "cudnn",
          torch.backends.cudnn.version(), torch.cuda.get_device_name(), flush=True)
    torch.manual_seed(0)
    cfg = vision_config()
    with torch.device("cuda"):
        model = Qwen3_5MoeVisionModel(cfg).to(torch.bfloat16)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    K = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    for name, grids in BATCHES.items():
        N, M, fwd_flops, bwd_flops = tower_flops(cfg, grids)
        pixels = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        grid_thw = torch.tensor(grids, device="cuda", dtype=torch.int64)

        def forward():
            out = model(hidden_states=pixels, grid_thw=grid_thw)
            return out.pooler_output if hasattr(out, "pooler_output") else out

        with torch.no_grad():
            merged = forward()
        assert merged.shape == (M, cfg.out_hidden_size), merged.shape
        grad = torch.randn_like(merged) * 1e-2

        def fwd_bwd():
            model.zero_grad(set_to_none=True)
            forward().backward(grad)

        # The forward with autograd's graph kept, as in training.
        fwd_ms = median_ms(lambda: forward(), iters=7, warmup=2)
        both_ms = median_ms(fwd_bwd, iters=7, warmup=2)
        row = {"batch": name, "patches": N, "merged": M, "params": params, "fwd_ms": round(fwd_ms, 2),
               "fwd_bwd_ms": round(both_ms, 2), "fwd_tflops": round(fwd_flops / fwd_ms / 1e9, 1),
               "fwd_bwd_tflops": round((fwd_flops + bwd_flops) / both_ms / 1e9, 1),
               "floor_fwd_bwd_ms": round((fwd_flops + bwd_flops) / PEAK_TFLOPS / 1e9, 2),
               "peak_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)}
        print("VISION_ANCHOR", json.dumps(row), flush=True)
        del pixels, grad, merged
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
