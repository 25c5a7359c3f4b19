// GpuVisionModel: planning, the staged image upload, and the forward / backward schedules of the
// vision tower, op for op as model/vision/vision_tower.cc and vision_block.cc; each block's
// residual add is fused into the LayerNorm that follows it (the next block's norm1, or the merger's)
// and kept in fp32, as is the stream gradient (with a bf16 copy for the branch products).
#include "model/vision/gpu/gpu_vision_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/cuda_check.h"
#include "core/device_alloc.h"
#include "core/error.h"
#include "kernels/bias_add/bias_add_cuda.h"
#include "kernels/bidirectional_attention/bidirectional_attention_cuda.h"
#include "kernels/cudnn_sdpa/gpu/cudnn_attention_choice.h"
#include "kernels/cudnn_sdpa/gpu/cudnn_sdpa.h"
#include "kernels/gelu/gelu_cuda.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/layer_norm/layer_norm_cuda.h"
#include "kernels/lora/lora_cuda.h"
#include "kernels/vision_grid/vision_grid.h"
#include "kernels/vision_pos_embed/vision_pos_embed.h"
#include "kernels/vision_pos_embed/vision_pos_embed_cuda.h"
#include "kernels/vision_rope/vision_rope.h"
#include "kernels/vision_rope/vision_rope_cuda.h"
#include "model/arena_carver.h"
#include "model/vision/vision_tower.h"
#include "model/gpu/param_init.h"

namespace deltamoe {

namespace {

using Bf16 = __nv_bfloat16;

// The reference's constants (vision_tower.cc, vision_block.cc).
constexpr double kLayerNormEps = 1e-6;
constexpr double kVisionRopeTheta = 10000.0;

GeluKind block_gelu_kind(const VisionConfig& config) {
  if (config.hidden_act == "gelu_pytorch_tanh") return GeluKind::tanh;
  if (config.hidden_act == "gelu") return GeluKind::exact;
  RAISE("gpu vision model: hidden_act '", config.hidden_act, "' is not supported (gelu_pytorch_tanh or gelu)");
}

// Frames per batch the cuDNN plans hold (the text model's max_seqs): a batch with more frames takes
// our kernel.
constexpr int64_t kCudnnMaxFrames = 64;

// The blocks' attention through cuDNN's fused SDPA: non-causal within each frame, plans for up to
// max_patches rows in min(max_images, kCudnnMaxFrames) frames. q and k are zero-padded per head to
// vision_qk_head_stride (80 for Qwen3.5's D = 72: cuDNN's dQ is wrong at a query/key head dim that
// is not a multiple of 16, cudnn_sdpa.h); v and the output keep D; the scale stays D^-0.5.
CudnnSdpaConfig vision_cudnn_config(const VisionConfig& config, int64_t max_patches, int64_t max_images) {
  CudnnSdpaConfig c;
  c.max_tokens = max_patches;
  c.max_segments = std::min(max_images, kCudnnMaxFrames);
  c.num_q_heads = config.num_heads;
  c.num_kv_heads = config.num_heads;
  c.head_dim = vision_qk_head_stride(config);
  c.value_dim = config.head_dim();
  c.causal = false;
  c.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(config.head_dim())));
  // A batch's frames are far shorter than its patches (8 x 784 of 6,272): plans with fewer rows
  // per frame, which the host picks from the frames it lays out (set_images).
  c.sequence_plans = true;
  return c;
}

// The largest scratch any backward kernel asks for (they run one at a time on the stream).
size_t vision_workspace_bytes(const VisionConfig& config, int64_t N, int64_t max_images) {
  const int64_t C = config.hidden_size, I = config.intermediate_size, H = config.num_heads;
  const int64_t m = config.spatial_merge_size, M = N / (m * m), wide = config.merged_dim(), O = config.out_hidden_size;
  size_t bytes = 256;
  for (size_t b : {layer_norm_backward_workspace_bytes(N, C), gelu_backward_workspace_bytes(N, I, true),
                   gelu_backward_workspace_bytes(M, wide, true), bias_add_backward_workspace_bytes(N, 3 * C),
                   bias_add_backward_workspace_bytes(N, I), bias_add_backward_workspace_bytes(N, C),
                   bias_add_backward_workspace_bytes(M, O), bidirectional_attention_backward_workspace_bytes(N, H),
                   cudnn_attention_workspace_reserve(vision_cudnn_config(config, N, max_images))})
    bytes = std::max(bytes, b);
  return bytes;
}

VisionActivationSpec activation_spec(int64_t max_patches, int64_t max_images, bool vit_trained, bool merger_trained,
                                     int64_t recompute_blocks) {
  VisionActivationSpec spec;
  spec.recompute_blocks = vit_trained ? recompute_blocks : 0;
  spec.max_patches = max_patches;
  spec.max_images = max_images;
  spec.blocks_backward = vit_trained;
  spec.any_backward = vit_trained || merger_trained;
  return spec;
}

}  // namespace

// Pinned host copies of one batch's inputs (laid out as on the device) and the event after which
// the stream has read them.
struct GpuVisionModel::Staging {
  void* block = nullptr;
  VisionInputs host;
  cudaEvent_t consumed = nullptr;
  ~Staging() {
    if (consumed != nullptr) cudaEventDestroy(consumed);
    if (block != nullptr) cudaFreeHost(block);
  }
};

size_t GpuVisionModel::lora_scratch_bytes(int64_t max_patches, int64_t lora_rank) {
  return 2 * static_cast<size_t>(max_patches * lora_rank) * sizeof(Bf16);
}

GpuVisionBytes GpuVisionModel::planned_bytes(const VisionConfig& config, int64_t max_patches, int64_t max_images,
                                             bool vit_trained, bool merger_trained, int64_t lora_rank,
                                             int64_t recompute_blocks, int64_t lora_dropout_max_in) {
  const VisionActivationSpec spec =
      activation_spec(max_patches, max_images, vit_trained, merger_trained, recompute_blocks);
  GpuVisionBytes bytes;
  bytes.activations = vision_activation_bytes(config, spec);
  bytes.workspace = vision_workspace_bytes(config, max_patches, max_images) + kGemmDefaultWorkspaceBytes +
                    lora_scratch_bytes(max_patches, lora_rank) +
                    (lora_dropout_max_in > 0 ? lora_dropout_scratch_bytes(max_patches, lora_dropout_max_in) : 0);
  bytes.inputs = vision_input_bytes(config, spec);
  return bytes;
}

GpuVisionModel::GpuVisionModel(const VisionConfig& config, const VisionWeights& weights, int64_t max_patches,
                               int64_t max_images, cudaStream_t stream, int64_t recompute_blocks,
                               int64_t lora_dropout_max_in)
    : config_(config), weights_(weights), max_patches_(max_patches), max_images_(max_images), stream_(stream) {
  const int64_t m = config_.spatial_merge_size;
  CHECK(config_.deepstack_visual_indexes.empty(), "gpu vision model: deepstack features are not part of Qwen3.5");
  CHECK(config_.num_heads >= 1 && config_.hidden_size % config_.num_heads == 0 && config_.head_dim() % 4 == 0 &&
            config_.head_dim() <= 256,
        "gpu vision model: hidden_size ", config_.hidden_size, " / num_heads ", config_.num_heads,
        " must give a head dim divisible by 4 and at most 256");
  CHECK(m >= 1, "gpu vision model: spatial_merge_size must be positive, got ", m);
  CHECK(max_patches_ >= m * m, "gpu vision model: max_patches must hold at least one merge block (", m * m,
        " patches), got ", max_patches_);
  CHECK(max_images_ >= 1, "gpu vision model: max_images must be positive, got ", max_images_);
  CHECK(recompute_blocks >= 0 && recompute_blocks <= config_.depth, "gpu vision model: ", recompute_blocks,
        " recomputed blocks, the tower has ", config_.depth);
  CHECK(static_cast<int64_t>(weights_.blocks.size()) == config_.depth, "gpu vision model: ", weights_.blocks.size(),
        " bound blocks for depth ", config_.depth);
  block_gelu_kind(config_);  // rejects an unknown activation now rather than in the first forward
  CHECK(layer_norm_cuda_takes(config_.hidden_size), "gpu vision model: hidden_size ", config_.hidden_size,
        " is wider than the LayerNorm kernels take (3,072 columns, a multiple of 8; else 1,024)");
  grid_side_ = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(config_.num_position_embeddings))));
  CHECK(grid_side_ * grid_side_ == config_.num_position_embeddings, "gpu vision model: num_position_embeddings ",
        config_.num_position_embeddings, " is not a square");
  max_segments_ = vision_max_segments(config_, max_patches_);
  gemm_ = std::make_unique<GemmContext>();
  spec_ = activation_spec(max_patches_, max_images_, weights_.vit_trained(), weights_.merger_trained(),
                          recompute_blocks);
  lora_rank_ = weights_.lora_rank();
  bytes_ = planned_bytes(config_, max_patches_, max_images_, weights_.vit_trained(), weights_.merger_trained(),
                         lora_rank_, recompute_blocks, lora_dropout_max_in);
  arena_ = std::make_unique<DeviceArena>(bytes_.activations, "gpu vision activations");
  ArenaCarver carver(arena_.get());
  carve_vision_activations(carver, config_, spec_, &acts_);
  const size_t dropout_bytes =
      lora_dropout_max_in > 0 ? lora_dropout_scratch_bytes(max_patches_, lora_dropout_max_in) : 0;
  workspace_bytes_ =
      bytes_.workspace - kGemmDefaultWorkspaceBytes - lora_scratch_bytes(max_patches_, lora_rank_) - dropout_bytes;
  if (dropout_bytes > 0) lora_dropout_scratch_ = DeviceBuffer(dropout_bytes);
  workspace_ = DeviceBuffer(workspace_bytes_);
  cudnn_attention_ = choose_cudnn_attention(vision_cudnn_config(config_, max_patches_, max_images_), workspace_bytes_,
                                            "gpu vision model attention");
  if (lora_rank_ > 0) lora_scratch_ = DeviceBuffer(lora_scratch_bytes(max_patches_, lora_rank_));
  inputs_arena_ = std::make_unique<DeviceArena>(bytes_.inputs, "gpu vision inputs");
  ArenaCarver input_carver(inputs_arena_.get());
  carve_vision_inputs(input_carver, config_, spec_, &inputs_);
  staging_ = std::make_unique<Staging>();
  staging_->block = pinned_malloc(bytes_.inputs, "gpu vision model: input staging");
  ArenaCarver staging_carver(staging_->block, bytes_.inputs);
  carve_vision_inputs(staging_carver, config_, spec_, &staging_->host);
  CUDA_CHECK(cudaEventCreateWithFlags(&staging_->consumed, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(staging_->consumed, stream_));
}

bool GpuVisionModel::use_cudnn_attention() const {
  return cudnn_attention_ != nullptr && num_segments_ <= cudnn_attention_->config().max_segments;
}

int64_t GpuVisionModel::qk_head_stride() const {
  return use_cudnn_attention() ? vision_qk_head_stride(config_) : config_.head_dim();
}

const char* GpuVisionModel::attention_backend() const { return cudnn_attention_ != nullptr ? "cudnn" : "ours"; }

GpuVisionModel::~GpuVisionModel() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
}

int64_t GpuVisionModel::num_merged() const {
  return num_patches_ / (config_.spatial_merge_size * config_.spatial_merge_size);
}

void GpuVisionModel::set_images(const float* pixel_values, int64_t num_patches,
                                const std::vector<std::array<int64_t, 3>>& grid_thw) {
  const int64_t num_images = static_cast<int64_t>(grid_thw.size());
  const int64_t m = config_.spatial_merge_size, K = config_.patch_dim(), D = config_.head_dim();
  CHECK(num_images >= 1 && num_images <= max_images_, "gpu vision model: ", num_images,
        " images, the model was planned for 1..", max_images_);
  CHECK(pixel_values != nullptr, "gpu vision model: pixel_values is null");
  std::vector<int64_t> grids;
  for (const auto& g : grid_thw) grids.insert(grids.end(), g.begin(), g.end());
  // Validates every grid (positive, h and w multiples of the merge size) while listing positions.
  int64_t expected = 0;
  for (int64_t i = 0; i < num_images; ++i) {
    const int64_t t = grids[i * 3], h = grids[i * 3 + 1], w = grids[i * 3 + 2];
    CHECK(t > 0 && h > 0 && w > 0 && h % m == 0 && w % m == 0, "gpu vision model: image ", i, ": grid_thw [", t, ", ",
          h, ", ", w, "] must be positive with h and w multiples of the merge size ", m);
    expected += t * h * w;
  }
  CHECK(expected == num_patches, "gpu vision model: image_grid_thw describes ", expected, " patches, pixel_values has ",
        num_patches, " rows");
  CHECK(num_patches <= max_patches_, "gpu vision model: ", num_patches, " patches, the model was planned for at most ",
        max_patches_);
  const int64_t N = num_patches;
  std::vector<int32_t> cu_seqlens = {0};
  for (int64_t i = 0; i < num_images; ++i)
    for (int64_t frame = 0; frame < grids[i * 3]; ++frame)
      cu_seqlens.push_back(static_cast<int32_t>(cu_seqlens.back() + grids[i * 3 + 1] * grids[i * 3 + 2]));
  const int64_t segments = static_cast<int64_t>(cu_seqlens.size()) - 1;
  int64_t longest = 0;
  for (int64_t i = 0; i < segments; ++i) longest = std::max<int64_t>(longest, cu_seqlens[i + 1] - cu_seqlens[i]);
  CHECK(segments <= max_segments_, "gpu vision model: ", segments, " image frames, the model was planned for ",
        max_segments_);
  // The same host-built fp32 tables and taps as the reference, so both rotate and resample alike.
  std::vector<int64_t> positions(static_cast<size_t>(N * 2));
  vision_rope_positions(grids.data(), num_images, m, positions.data());
  std::vector<float> cos(static_cast<size_t>(N * D / 2)), sin(cos.size());
  vision_rope_tables_ref(positions.data(), N, D, kVisionRopeTheta, cos.data(), sin.data());
  std::vector<int64_t> tap_index(static_cast<size_t>(N * 4));
  std::vector<float> tap_weight(static_cast<size_t>(N * 4));
  vision_pos_embed_taps(grids.data(), num_images, grid_side_, m, tap_index.data(), tap_weight.data());
  const int64_t table_rows = config_.num_position_embeddings;
  std::vector<int32_t> row_offsets(static_cast<size_t>(table_rows + 1)), entries(static_cast<size_t>(N * 4));
  vision_pos_embed_invert_taps(tap_index.data(), N, table_rows, row_offsets.data(), entries.data());

  // The stream must have read the previous batch's staging before it is refilled.
  CUDA_CHECK(cudaEventSynchronize(staging_->consumed));
  const VisionInputs& host = staging_->host;
  uint64_t uploaded = 0;
  auto stage = [&](void* device, void* pinned, const void* values, size_t bytes) {
    std::memcpy(pinned, values, bytes);
    CUDA_CHECK(cudaMemcpyAsync(device, pinned, bytes, cudaMemcpyHostToDevice, stream_));
    uploaded += bytes;
  };
  stage(inputs_.pixels_f32, host.pixels_f32, pixel_values, static_cast<size_t>(N * K) * sizeof(float));
  convert_f32_to_bf16_cuda(inputs_.pixels_f32, inputs_.pixels, N * K, stream_);
  stage(inputs_.cu_seqlens, host.cu_seqlens, cu_seqlens.data(), cu_seqlens.size() * sizeof(int32_t));
  stage(inputs_.rope_cos, host.rope_cos, cos.data(), cos.size() * sizeof(float));
  stage(inputs_.rope_sin, host.rope_sin, sin.data(), sin.size() * sizeof(float));
  stage(inputs_.tap_index, host.tap_index, tap_index.data(), tap_index.size() * sizeof(int64_t));
  stage(inputs_.tap_weight, host.tap_weight, tap_weight.data(), tap_weight.size() * sizeof(float));
  stage(inputs_.tap_row_offsets, host.tap_row_offsets, row_offsets.data(), row_offsets.size() * sizeof(int32_t));
  stage(inputs_.tap_entries, host.tap_entries, entries.data(), entries.size() * sizeof(int32_t));
  CUDA_CHECK(cudaEventRecord(staging_->consumed, stream_));
  uploaded_bytes_ += uploaded;
  num_patches_ = N;
  num_segments_ = segments;
  longest_segment_ = longest;
}

void GpuVisionModel::set_lora_dropout(const LoraDropoutKey& key) {
  CHECK(key.p == 0 || lora_dropout_scratch_.bytes() > 0, "gpu vision model: LoRA dropout ", key.p,
        " on a model planned without it (lora_dropout_max_in)");
  lora_dropout_ = key;
}

LoraDropoutPass GpuVisionModel::lora_dropout_pass(const DeviceLoraViews& views) const {
  return LoraDropoutPass{lora_dropout_mask(lora_dropout_, views.index), lora_dropout_scratch_.data(),
                         lora_dropout_scratch_.bytes()};
}

void GpuVisionModel::project(const DeviceParam& w, const DeviceParam& bias, const Bf16* x, Bf16* y, int64_t rows,
                             int64_t in_features, int64_t out_features) {
  linear_forward_bias_cuda(*gemm_, x, w.w, bias.w, y, rows, in_features, out_features, stream_);
  if (!w.lora.attached()) return;
  const LoraDeviceAdapter adapter{w.lora.a, w.lora.b, w.lora.grad_a, w.lora.grad_b, w.lora.rank, w.lora.scaling};
  const LoraDropoutPass dropout = lora_dropout_pass(w.lora);
  lora_linear_forward_cuda(*gemm_, x, adapter, lora_scratch_.as<Bf16>(), y, DType::bf16, rows, in_features,
                           out_features, stream_, &dropout);
}

void GpuVisionModel::lora_backward(const DeviceParam& w, const Bf16* x, const Bf16* dy, void* dx, DType dx_dtype,
                                   int64_t rows, int64_t in_features, int64_t out_features) {
  if (!w.lora.attached()) return;
  const LoraDeviceAdapter adapter{w.lora.a, w.lora.b, w.lora.grad_a, w.lora.grad_b, w.lora.rank, w.lora.scaling};
  Bf16* xa = lora_scratch_.as<Bf16>();
  Bf16* dxa = xa + max_patches_ * lora_rank_;
  const LoraDropoutPass dropout = lora_dropout_pass(w.lora);
  lora_linear_backward_cuda(*gemm_, x, dy, adapter, xa, /*recompute_xa=*/true, dxa, dx, dx_dtype, rows, in_features,
                            out_features, stream_, &dropout);
}

void GpuVisionModel::weight_grad(const DeviceParam& w, const Bf16* dy, const Bf16* x, int64_t rows,
                                 int64_t in_features, int64_t out_features) {
  if (w.grad == nullptr) return;
  linear_backward_weight_cuda(*gemm_, dy, x, w.grad, rows, in_features, out_features, stream_);
}

void GpuVisionModel::bias_grad(const DeviceParam& b, const void* dy, bool dy_f32, int64_t rows, int64_t features) {
  if (b.grad == nullptr) return;
  if (dy_f32) {
    bias_add_backward_cuda(static_cast<const float*>(dy), b.grad, rows, features, workspace_.data(), workspace_bytes_,
                           stream_);
  } else {
    bias_add_backward_cuda(static_cast<const Bf16*>(dy), b.grad, rows, features, workspace_.data(), workspace_bytes_,
                           stream_);
  }
}

void GpuVisionModel::forward(Bf16* merged_out) {
  CHECK(num_patches_ > 0, "gpu vision model: forward called before set_images");
  CHECK(merged_out != nullptr, "gpu vision model: forward needs an output buffer");
  const int64_t N = num_patches_, C = config_.hidden_size, K = config_.patch_dim();
  const int64_t M = num_merged(), wide = config_.merged_dim(), O = config_.out_hidden_size;
  const VisionWeights& W = weights_;
  // Patch embedding: the Conv3d with kernel = stride is a product with the flattened weight [C, K].
  // The bf16 projection (with its bias) plus the fp32 position table starts the fp32 stream.
  linear_forward_bias_cuda(*gemm_, inputs_.pixels, W.patch_weight.w, W.patch_bias.w, acts_.branch_out, N, K, C,
                           stream_);
  vision_pos_embed_forward_cuda(W.pos_embed.f32, inputs_.tap_index, inputs_.tap_weight, acts_.branch_out,
                                acts_.embedded, N, C, stream_);
  for (int64_t j = 0; j < config_.depth; ++j)
    block_forward(j, j == 0 ? nullptr : acts_.branch_out, j == 0 ? nullptr : acts_.blocks[static_cast<size_t>(j - 1)].h1);

  // Merger: LayerNorm per patch (fused with the last block's residual add), then each run of m^2
  // patches is one row of [M, 4C]: fc1 + bias, exact GELU, fc2 + bias.
  if (config_.depth > 0) {
    layer_norm_forward_cuda(acts_.branch_out, acts_.blocks.back().h1, acts_.merger_in, W.merger_norm_weight.f32,
                            W.merger_norm_bias.f32, acts_.merger_norm, acts_.merger_mean, acts_.merger_rstd, N, C,
                            kLayerNormEps, stream_);
  } else {
    layer_norm_forward_cuda(nullptr, acts_.embedded, nullptr, W.merger_norm_weight.f32, W.merger_norm_bias.f32,
                            acts_.merger_norm, acts_.merger_mean, acts_.merger_rstd, N, C, kLayerNormEps, stream_);
  }
  // Every linear with a bias rounds x W^T + b once (linear_forward_bias_cuda), as autocast does.
  project(W.merger_fc1_weight, W.merger_fc1_bias, acts_.merger_norm, acts_.merger_fc1, M, wide, wide);
  gelu_forward_cuda(GeluKind::exact, acts_.merger_fc1, nullptr, nullptr, acts_.merger_act, M, wide, stream_);
  project(W.merger_fc2_weight, W.merger_fc2_bias, acts_.merger_act, merged_out, M, wide, O);
}

void GpuVisionModel::block_forward(int64_t block, const Bf16* prev_mlp_out, const float* prev_h1, bool rerun) {
  VisionBlockActivations& b = acts_.blocks[static_cast<size_t>(block)];
  const VisionBlockWeights& W = weights_.blocks[static_cast<size_t>(block)];
  const int64_t N = num_patches_, C = config_.hidden_size, I = config_.intermediate_size;
  const int64_t H = config_.num_heads, D = config_.head_dim();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  if (prev_mlp_out == nullptr) {
    // The kept fp32 sum normalised from memory gives the fused pass's values bit for bit (the same
    // kernel, the same s in fp32).
    layer_norm_forward_cuda(nullptr, b.x_in, nullptr, W.norm1_weight.f32, W.norm1_bias.f32, b.ln1, b.mean1, b.rstd1, N,
                            C, kLayerNormEps, stream_);
  } else {
    // x_in = previous h1 + previous MLP output (the previous block's residual add).
    layer_norm_forward_cuda(prev_mlp_out, prev_h1, b.x_in, W.norm1_weight.f32, W.norm1_bias.f32, b.ln1, b.mean1,
                            b.rstd1, N, C, kLayerNormEps, stream_);
  }
  project(W.qkv_weight, W.qkv_bias, b.ln1, acts_.qkv, N, C, 3 * C);
  // qkv rows are [q | k | v]; q and k are rotated out into the layout attention reads ([N, H, D] for
  // our kernel, heads zero-padded to Dqk for cuDNN's) and v copied beside them, in one pass.
  vision_qkv_rope_forward_cuda(acts_.qkv, 3 * C, b.q, b.k, b.v, inputs_.rope_cos, inputs_.rope_sin, N, H, D,
                               qk_head_stride(), stream_);
  if (use_cudnn_attention()) {
    cudnn_attention_->forward(b.q, b.k, b.v, inputs_.cu_seqlens, num_segments_, b.attn, b.lse, workspace_.data(),
                              workspace_bytes_, stream_, longest_segment_);
  } else {
    bidirectional_attention_forward_cuda(b.q, b.k, b.v, inputs_.cu_seqlens, num_segments_, b.attn, b.lse, N, H, D,
                                         scale, stream_);
  }
  project(W.proj_weight, W.proj_bias, b.attn, acts_.branch_out, N, C, C);
  // h1 = x_in + proj, normalised in the same pass.
  layer_norm_forward_cuda(acts_.branch_out, b.x_in, b.h1, W.norm2_weight.f32, W.norm2_bias.f32, b.ln2, b.mean2,
                          b.rstd2, N, C, kLayerNormEps, stream_);
  project(W.fc1_weight, W.fc1_bias, b.ln2, b.fc1, N, C, I);
  gelu_forward_cuda(block_gelu_kind(config_), b.fc1, nullptr, nullptr, b.act, N, I, stream_);
  if (rerun) return;
  project(W.fc2_weight, W.fc2_bias, b.act, acts_.branch_out, N, I, C);
  // (branch_out + h1 is the next block's norm1 input, or the merger's.)
}

void GpuVisionModel::backward(const Bf16* d_merged) {
  CHECK(num_patches_ > 0, "gpu vision model: backward called before set_images");
  if (!spec_.any_backward) return;
  CHECK(d_merged != nullptr, "gpu vision model: backward needs d_merged");
  const int64_t N = num_patches_, C = config_.hidden_size, K = config_.patch_dim();
  const int64_t M = num_merged(), wide = config_.merged_dim(), O = config_.out_hidden_size;
  const VisionWeights& W = weights_;
  void* ws = workspace_.data();
  const size_t ws_bytes = workspace_bytes_;

  bias_grad(W.merger_fc2_bias, d_merged, false, M, O);
  weight_grad(W.merger_fc2_weight, d_merged, acts_.merger_act, M, wide, O);
  Bf16* d_wide = acts_.grad_wide;
  linear_backward_input_cuda(*gemm_, d_merged, W.merger_fc2_weight.w, d_wide, M, wide, O, stream_);
  lora_backward(W.merger_fc2_weight, acts_.merger_act, d_merged, d_wide, DType::bf16, M, wide, O);
  gelu_backward_cuda(GeluKind::exact, acts_.merger_fc1, d_wide, d_wide, W.merger_fc1_bias.grad, M, wide, ws, ws_bytes,
                     stream_);
  weight_grad(W.merger_fc1_weight, d_wide, acts_.merger_norm, M, wide, wide);
  if (!spec_.blocks_backward && W.merger_norm_weight.grad == nullptr && W.merger_norm_bias.grad == nullptr) {
    lora_backward(W.merger_fc1_weight, acts_.merger_norm, d_wide, nullptr, DType::f32, M, wide, wide);
    report(GradientPhaseKind::vision_merger, 0);
    return;
  }
  // The LayerNorm backward reads this product's fp32 accumulator unrounded.
  linear_backward_input_f32_cuda(*gemm_, d_wide, W.merger_fc1_weight.w, acts_.grad_norm, false, M, wide, wide, stream_);
  lora_backward(W.merger_fc1_weight, acts_.merger_norm, d_wide, acts_.grad_norm, DType::f32, M, wide, wide);
  const float* merger_x = config_.depth > 0 ? acts_.merger_in : acts_.embedded;
  layer_norm_backward_cuda(merger_x, W.merger_norm_weight.f32, acts_.merger_mean, acts_.merger_rstd, acts_.grad_norm,
                           nullptr, acts_.grad_stream, acts_.grad_stream_bf16, W.merger_norm_weight.grad,
                           W.merger_norm_bias.grad, {}, N, C, ws, ws_bytes, stream_);
  report(GradientPhaseKind::vision_merger, 0);
  if (!spec_.blocks_backward) return;  // nothing below the merger is trained

  for (int64_t j = config_.depth - 1; j >= 0; --j) {
    // A recomputed block reruns its forward from its kept input into the shared set first; the
    // rerun touches no gradient buffer (grad_stream holds the gradient reaching its output).
    if (j < spec_.recompute_blocks) block_forward(j, nullptr, nullptr, /*rerun=*/true);
    block_backward(j);
    report(GradientPhaseKind::vision_block, j);
  }
  // grad_stream: the gradient of the embedding (patch projection + bias + position embedding); the
  // fp32 table and the bias take it in fp32, the bf16 projection's weight its bf16 copy.
  if (W.pos_embed.grad != nullptr) {
    vision_pos_embed_backward_cuda(acts_.grad_stream, inputs_.tap_weight, inputs_.tap_row_offsets, inputs_.tap_entries,
                                   W.pos_embed.grad, N, config_.num_position_embeddings, C, stream_);
  }
  bias_grad(W.patch_bias, acts_.grad_stream, true, N, C);
  weight_grad(W.patch_weight, acts_.grad_stream_bf16, inputs_.pixels, N, K, C);
  report(GradientPhaseKind::vision_input, 0);
}

void GpuVisionModel::report(GradientPhaseKind kind, int64_t index) {
  if (gradient_ready_) gradient_ready_({kind, index});
}

void GpuVisionModel::block_backward(int64_t block) {
  const VisionBlockActivations& b = acts_.blocks[static_cast<size_t>(block)];
  const VisionBlockWeights& W = weights_.blocks[static_cast<size_t>(block)];
  const int64_t N = num_patches_, C = config_.hidden_size, I = config_.intermediate_size;
  const int64_t H = config_.num_heads, D = config_.head_dim();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  void* ws = workspace_.data();
  const size_t ws_bytes = workspace_bytes_;
  const Bf16* d_out = acts_.grad_stream_bf16;
  // MLP branch: d_out reaches both fc2 and, through the residual, h1. Biases whose output joins the
  // stream take their gradient from the fp32 stream gradient: norm2's backward sums the one it reads
  // (fc2's) and the one it writes (proj's) on its pass.
  linear_backward_input_cuda(*gemm_, d_out, W.fc2_weight.w, acts_.grad_wide, N, I, C, stream_);
  lora_backward(W.fc2_weight, b.act, d_out, acts_.grad_wide, DType::bf16, N, I, C);
  weight_grad(W.fc2_weight, d_out, b.act, N, I, C);
  gelu_backward_cuda(block_gelu_kind(config_), b.fc1, acts_.grad_wide, acts_.grad_wide, W.fc1_bias.grad, N, I, ws,
                     ws_bytes, stream_);
  // The LayerNorm backward reads this product's fp32 accumulator unrounded.
  linear_backward_input_f32_cuda(*gemm_, acts_.grad_wide, W.fc1_weight.w, acts_.grad_norm, false, N, C, I, stream_);
  lora_backward(W.fc1_weight, b.ln2, acts_.grad_wide, acts_.grad_norm, DType::f32, N, C, I);
  weight_grad(W.fc1_weight, acts_.grad_wide, b.ln2, N, C, I);
  layer_norm_backward_cuda(b.h1, W.norm2_weight.f32, b.mean2, b.rstd2, acts_.grad_norm, acts_.grad_stream,
                           acts_.grad_h1, acts_.grad_h1_bf16, W.norm2_weight.grad, W.norm2_bias.grad,
                           {.of_d_skip = W.fc2_bias.grad, .of_dx = W.proj_bias.grad}, N, C, ws, ws_bytes, stream_);
  // Attention branch: the gradient reaching h1 reaches both proj and, through the residual, x_in.
  linear_backward_input_cuda(*gemm_, acts_.grad_h1_bf16, W.proj_weight.w, acts_.grad_attn, N, C, C, stream_);
  lora_backward(W.proj_weight, b.attn, acts_.grad_h1_bf16, acts_.grad_attn, DType::bf16, N, C, C);
  weight_grad(W.proj_weight, acts_.grad_h1_bf16, b.attn, N, C, C);
  if (use_cudnn_attention()) {
    cudnn_attention_->backward(b.q, b.k, b.v, b.attn, b.lse, acts_.grad_attn, inputs_.cu_seqlens, num_segments_,
                               acts_.grad_q, acts_.grad_k, acts_.grad_v, ws, ws_bytes, stream_, longest_segment_);
  } else {
    bidirectional_attention_backward_cuda(b.q, b.k, b.v, b.attn, b.lse, acts_.grad_attn, inputs_.cu_seqlens,
                                          num_segments_, acts_.grad_q, acts_.grad_k, acts_.grad_v, N, H, D, scale, ws,
                                          ws_bytes, stream_);
  }
  // d_qkv [N, 3C] = [rope^-1(dq) | rope^-1(dk) | dv], one pass.
  Bf16* d_qkv = acts_.grad_wide;
  vision_qkv_rope_backward_cuda(acts_.grad_q, acts_.grad_k, acts_.grad_v, d_qkv, 3 * C, inputs_.rope_cos,
                                inputs_.rope_sin, N, H, D, qk_head_stride(), stream_);
  bias_grad(W.qkv_bias, d_qkv, false, N, 3 * C);
  // The LayerNorm backward reads this product's fp32 accumulator unrounded.
  linear_backward_input_f32_cuda(*gemm_, d_qkv, W.qkv_weight.w, acts_.grad_norm, false, N, C, 3 * C, stream_);
  lora_backward(W.qkv_weight, b.ln1, d_qkv, acts_.grad_norm, DType::f32, N, C, 3 * C);
  weight_grad(W.qkv_weight, d_qkv, b.ln1, N, C, 3 * C);
  // The stream gradient is free again (norm2's backward consumed it): it now receives the input's.
  layer_norm_backward_cuda(b.x_in, W.norm1_weight.f32, b.mean1, b.rstd1, acts_.grad_norm, acts_.grad_h1,
                           acts_.grad_stream, acts_.grad_stream_bf16, W.norm1_weight.grad, W.norm1_bias.grad, {}, N, C,
                           ws, ws_bytes, stream_);
}

}  // namespace deltamoe
