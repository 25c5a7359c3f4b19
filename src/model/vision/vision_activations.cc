// The vision tower's activation and input layouts (vision_activations.h): one carve, counted or real.
#include "model/vision/vision_activations.h"

#include <algorithm>

#include "core/error.h"

namespace deltamoe {

namespace {

void carve_block(ArenaCarver& c, int64_t N, int64_t C, int64_t I, int64_t H, int64_t QK, VisionBlockActivations* b) {
  b->ln1 = c.take<DeviceBf16>(N * C);
  b->mean1 = c.take<float>(N);
  b->rstd1 = c.take<float>(N);
  b->q = c.take<DeviceBf16>(N * QK);
  b->k = c.take<DeviceBf16>(N * QK);
  b->v = c.take<DeviceBf16>(N * C);
  b->attn = c.take<DeviceBf16>(N * C);
  b->lse = c.take<float>(N * H);
  b->h1 = c.take<float>(N * C);
  b->ln2 = c.take<DeviceBf16>(N * C);
  b->mean2 = c.take<float>(N);
  b->rstd2 = c.take<float>(N);
  b->fc1 = c.take<DeviceBf16>(N * I);
  b->act = c.take<DeviceBf16>(N * I);
}

}  // namespace

void carve_vision_activations(ArenaCarver& c, const VisionConfig& config, const VisionActivationSpec& spec,
                              VisionActivations* out) {
  const int64_t m = config.spatial_merge_size;
  CHECK(spec.max_patches >= m * m, "vision activations: max_patches must hold at least one merge block (", m * m,
        " patches), got ", spec.max_patches);
  const int64_t N = spec.max_patches, C = config.hidden_size, I = config.intermediate_size, H = config.num_heads;
  const int64_t M = N / (m * m), wide = config.merged_dim(), QK = H * vision_qk_head_stride(config);
  out->embedded = c.take<float>(N * C);
  out->blocks.assign(static_cast<size_t>(config.depth), VisionBlockActivations{});
  if (spec.blocks_backward) {
    CHECK(spec.recompute_blocks >= 0 && spec.recompute_blocks <= config.depth, "vision activations: ",
          spec.recompute_blocks, " recomputed blocks in a tower of ", config.depth);
    // Recomputed blocks compute in one shared set (each block's rerun refills it before that
    // block's backward); the block after them reads the shared h1 before it writes anything shared.
    VisionBlockActivations shared;
    if (spec.recompute_blocks > 0) carve_block(c, N, C, I, H, QK, &shared);
    for (int64_t j = 0; j < config.depth; ++j) {
      VisionBlockActivations& b = out->blocks[static_cast<size_t>(j)];
      if (j < spec.recompute_blocks) b = shared;
      // Block 0 normalises the embedding itself; later blocks keep the fused residual sum.
      b.x_in = j == 0 ? out->embedded : c.take<float>(N * C);
      if (j >= spec.recompute_blocks) carve_block(c, N, C, I, H, QK, &b);
    }
  } else if (config.depth > 0) {
    // Nothing is kept for a backward: every block computes in one set of buffers (block 0 reads the
    // embedding, later blocks one shared stream buffer, so no block reads what it writes).
    VisionBlockActivations shared;
    carve_block(c, N, C, I, H, QK, &shared);
    float* stream = c.take<float>(N * C);
    for (int64_t j = 0; j < config.depth; ++j) {
      VisionBlockActivations& b = out->blocks[static_cast<size_t>(j)];
      b = shared;
      b.x_in = j == 0 ? out->embedded : stream;
    }
  }
  out->qkv = c.take<DeviceBf16>(N * 3 * C);
  out->branch_out = c.take<DeviceBf16>(N * C);
  out->merger_in = c.take<float>(N * C);
  out->merger_norm = c.take<DeviceBf16>(N * C);
  out->merger_mean = c.take<float>(N);
  out->merger_rstd = c.take<float>(N);
  out->merger_fc1 = c.take<DeviceBf16>(M * wide);
  out->merger_act = c.take<DeviceBf16>(M * wide);
  if (!spec.any_backward) return;
  out->grad_stream = c.take<float>(N * C);
  out->grad_stream_bf16 = c.take<DeviceBf16>(N * C);
  out->grad_h1 = c.take<float>(N * C);
  out->grad_h1_bf16 = c.take<DeviceBf16>(N * C);
  out->grad_norm = c.take<float>(N * C);
  out->grad_wide = c.take<DeviceBf16>(std::max({N * I, N * 3 * C, M * wide}));
  out->grad_attn = c.take<DeviceBf16>(N * C);
  out->grad_q = c.take<DeviceBf16>(N * QK);
  out->grad_k = c.take<DeviceBf16>(N * QK);
  out->grad_v = c.take<DeviceBf16>(N * C);
}

size_t vision_activation_bytes(const VisionConfig& config, const VisionActivationSpec& spec) {
  ArenaCarver counter(nullptr);
  VisionActivations unused;
  carve_vision_activations(counter, config, spec, &unused);
  return counter.used();
}

int64_t vision_qk_head_stride(const VisionConfig& config) { return (config.head_dim() + 15) / 16 * 16; }

int64_t vision_max_segments(const VisionConfig& config, int64_t max_patches) {
  const int64_t m = config.spatial_merge_size;
  return std::max<int64_t>(max_patches / (m * m), 1);
}

void carve_vision_inputs(ArenaCarver& c, const VisionConfig& config, const VisionActivationSpec& spec,
                         VisionInputs* out) {
  const int64_t N = spec.max_patches, K = config.patch_dim(), half = config.head_dim() / 2;
  out->pixels_f32 = c.take<float>(N * K);
  out->pixels = c.take<DeviceBf16>(N * K);
  out->cu_seqlens = c.take<int32_t>(vision_max_segments(config, N) + 1);
  out->rope_cos = c.take<float>(N * half);
  out->rope_sin = c.take<float>(N * half);
  out->tap_index = c.take<int64_t>(N * 4);
  out->tap_weight = c.take<float>(N * 4);
  out->tap_row_offsets = c.take<int32_t>(config.num_position_embeddings + 1);
  out->tap_entries = c.take<int32_t>(N * 4);
}

size_t vision_input_bytes(const VisionConfig& config, const VisionActivationSpec& spec) {
  ArenaCarver counter(nullptr);
  VisionInputs unused;
  carve_vision_inputs(counter, config, spec, &unused);
  return counter.used();
}

}  // namespace deltamoe
