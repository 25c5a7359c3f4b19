// GpuVisionModel: planning, parameter and image upload, and the forward / backward schedules of the
// vision tower, op for op as model/vision/vision_tower.cc and vision_block.cc; each block's
// residual add is fused into the LayerNorm that follows it (the next block's norm1, or the merger's)
// and kept in fp32, as is the stream gradient (with a bf16 copy for the branch products).
#include "train/gpu/gpu_vision_model.h"

#include <algorithm>
#include <cmath>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/bias_add/bias_add_cuda.h"
#include "kernels/bidirectional_attention/bidirectional_attention_cuda.h"
#include "kernels/gelu/gelu_cuda.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/layer_norm/layer_norm_cuda.h"
#include "kernels/vision_grid/vision_grid.h"
#include "kernels/vision_pos_embed/vision_pos_embed.h"
#include "kernels/vision_pos_embed/vision_pos_embed_cuda.h"
#include "kernels/vision_rope/vision_rope.h"
#include "kernels/vision_rope/vision_rope_cuda.h"
#include "model/vision/vision_tower.h"
#include "train/gpu/arena_carver.h"
#include "train/gpu/param_init.h"

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

std::vector<float> download_f32(const float* device, int64_t count, cudaStream_t stream) {
  std::vector<float> host(static_cast<size_t>(count));
  CUDA_CHECK(cudaMemcpyAsync(host.data(), device, host.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

void copy_columns(const Bf16* src, int64_t ld_src, Bf16* dst, int64_t ld_dst, int64_t width, int64_t rows,
                  cudaStream_t stream) {
  CUDA_CHECK(cudaMemcpy2DAsync(dst, static_cast<size_t>(ld_dst) * sizeof(Bf16), src,
                               static_cast<size_t>(ld_src) * sizeof(Bf16), static_cast<size_t>(width) * sizeof(Bf16),
                               static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, stream));
}

}  // namespace

GpuVisionModel::GpuVisionModel(const VisionConfig& config, std::string prefix, int64_t max_patches,
                               int64_t max_images, cudaStream_t stream)
    : config_(config), prefix_(std::move(prefix)), max_patches_(max_patches), max_images_(max_images),
      stream_(stream) {
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
  block_gelu_kind(config_);  // rejects an unknown activation now rather than in the first forward
  grid_side_ = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(config_.num_position_embeddings))));
  CHECK(grid_side_ * grid_side_ == config_.num_position_embeddings, "gpu vision model: num_position_embeddings ",
        config_.num_position_embeddings, " is not a square");
  // Every frame covers at least one merge block, so there are at most max_patches / m^2 segments.
  max_segments_ = max_patches_ / (m * m);
  for (const auto& [name, shape] : vision_param_shapes(config_, prefix_)) layout_.add(name, shape.to_vector());
  const int64_t n = layout_.total_numel();
  gemm_ = std::make_unique<GemmContext>();
  master_ = DeviceBuffer(static_cast<size_t>(n) * sizeof(float));
  grads_ = DeviceBuffer(static_cast<size_t>(n) * sizeof(float));
  weights_bf16_ = DeviceBuffer(static_cast<size_t>(n) * sizeof(Bf16));
  CUDA_CHECK(cudaMemsetAsync(master_.data(), 0, master_.bytes(), stream_));
  CUDA_CHECK(cudaMemsetAsync(grads_.data(), 0, grads_.bytes(), stream_));
  CUDA_CHECK(cudaMemsetAsync(weights_bf16_.data(), 0, weights_bf16_.bytes(), stream_));
  plan();
}

GpuVisionModel::~GpuVisionModel() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  else cudaDeviceSynchronize();
}

void GpuVisionModel::plan() {
  const int64_t N = max_patches_, C = config_.hidden_size, I = config_.intermediate_size, H = config_.num_heads;
  const int64_t m = config_.spatial_merge_size, M = N / (m * m), wide = config_.merged_dim();
  const int64_t K = config_.patch_dim(), half = config_.head_dim() / 2;
  const int64_t table_rows = config_.num_position_embeddings, O = config_.out_hidden_size;

  auto carve_activations = [&](ArenaCarver& c) {
    embedded_ = c.take<float>(N * C);
    blocks_.assign(static_cast<size_t>(config_.depth), GpuVisionBlockBuffers{});
    for (int64_t j = 0; j < config_.depth; ++j) {
      GpuVisionBlockBuffers& b = blocks_[static_cast<size_t>(j)];
      // Block 0 normalises the embedding itself; later blocks keep the fused residual sum.
      b.x_in = j == 0 ? embedded_ : c.take<float>(N * C);
      b.ln1 = c.take<Bf16>(N * C);
      b.mean1 = c.take<float>(N);
      b.rstd1 = c.take<float>(N);
      b.q = c.take<Bf16>(N * C);
      b.k = c.take<Bf16>(N * C);
      b.v = c.take<Bf16>(N * C);
      b.attn = c.take<Bf16>(N * C);
      b.lse = c.take<float>(N * H);
      b.h1 = c.take<float>(N * C);
      b.ln2 = c.take<Bf16>(N * C);
      b.mean2 = c.take<float>(N);
      b.rstd2 = c.take<float>(N);
      b.fc1 = c.take<Bf16>(N * I);
      b.act = c.take<Bf16>(N * I);
    }
    qkv_ = c.take<Bf16>(N * 3 * C);
    branch_out_ = c.take<Bf16>(N * C);
    merger_in_ = c.take<float>(N * C);
    merger_norm_ = c.take<Bf16>(N * C);
    merger_mean_ = c.take<float>(N);
    merger_rstd_ = c.take<float>(N);
    merger_fc1_ = c.take<Bf16>(M * wide);
    merger_act_ = c.take<Bf16>(M * wide);
    grad_stream_ = c.take<float>(N * C);
    grad_stream_bf16_ = c.take<Bf16>(N * C);
    grad_h1_ = c.take<float>(N * C);
    grad_h1_bf16_ = c.take<Bf16>(N * C);
    grad_norm_ = c.take<float>(N * C);
    grad_wide_ = c.take<Bf16>(std::max({N * I, N * 3 * C, M * wide}));
    grad_attn_ = c.take<Bf16>(N * C);
    grad_q_ = c.take<Bf16>(N * C);
    grad_k_ = c.take<Bf16>(N * C);
    grad_v_ = c.take<Bf16>(N * C);
  };
  ArenaCarver counter(nullptr);
  carve_activations(counter);
  activation_bytes_ = counter.used();
  arena_ = std::make_unique<DeviceArena>(activation_bytes_, "gpu vision activations");
  ArenaCarver carver(arena_.get());
  carve_activations(carver);

  auto carve_inputs = [&](ArenaCarver& c) {
    pixels_f32_ = c.take<float>(N * K);
    pixels_ = c.take<Bf16>(N * K);
    cu_seqlens_ = c.take<int32_t>(max_segments_ + 1);
    rope_cos_ = c.take<float>(N * half);
    rope_sin_ = c.take<float>(N * half);
    tap_index_ = c.take<int64_t>(N * 4);
    tap_weight_ = c.take<float>(N * 4);
    tap_row_offsets_ = c.take<int32_t>(table_rows + 1);
    tap_entries_ = c.take<int32_t>(N * 4);
  };
  ArenaCarver input_counter(nullptr);
  carve_inputs(input_counter);
  inputs_bytes_ = input_counter.used();
  inputs_ = std::make_unique<DeviceArena>(inputs_bytes_, "gpu vision inputs");
  ArenaCarver input_carver(inputs_.get());
  carve_inputs(input_carver);

  // The largest scratch any backward kernel asks for (they run one at a time on stream_).
  size_t bytes = 256;
  for (size_t b : {layer_norm_backward_workspace_bytes(N, C), gelu_backward_workspace_bytes(N, I, true),
                   gelu_backward_workspace_bytes(M, wide, true), bias_add_backward_workspace_bytes(N, 3 * C),
                   bias_add_backward_workspace_bytes(N, I), bias_add_backward_workspace_bytes(N, C),
                   bias_add_backward_workspace_bytes(M, O), bidirectional_attention_backward_workspace_bytes(N, H)})
    bytes = std::max(bytes, b);
  workspace_bytes_ = bytes;
  workspace_ = DeviceBuffer(workspace_bytes_);
}

int64_t GpuVisionModel::offset_of(const std::string& name) const {
  const std::string full = prefix_ + name;
  const int index = layout_.find(full);
  CHECK(index >= 0, "gpu vision model: no parameter '", full, "' in the layout");
  return layout_.entry(index).offset;
}

const Bf16* GpuVisionModel::weight(const std::string& name) const {
  return weights_bf16_.as<Bf16>() + offset_of(name);
}

const float* GpuVisionModel::master_weight(const std::string& name) const {
  return master_.as<float>() + offset_of(name);
}

float* GpuVisionModel::grad(const std::string& name) const { return grads_.as<float>() + offset_of(name); }

std::string GpuVisionModel::block_name(int64_t block, const char* leaf) const {
  return str_cat(".blocks.", block, ".", leaf);
}

int64_t GpuVisionModel::num_merged() const {
  return num_patches_ / (config_.spatial_merge_size * config_.spatial_merge_size);
}

void GpuVisionModel::upload_params(const ParamMap& params) {
  for (const ParamEntry& entry : layout_.entries()) {
    const auto found = params.find(entry.name);
    CHECK(found != params.end(), "gpu vision model: parameter '", entry.name, "' is missing");
    CHECK(static_cast<int64_t>(found->second.values.size()) == entry.numel, "gpu vision model: parameter '",
          entry.name, "' has ", found->second.values.size(), " values, expected ", entry.numel);
    CUDA_CHECK(cudaMemcpyAsync(master_.as<float>() + entry.offset, found->second.values.data(),
                               static_cast<size_t>(entry.numel) * sizeof(float), cudaMemcpyHostToDevice, stream_));
  }
  convert_f32_to_bf16_cuda(master_.as<float>(), weights_bf16_.as<Bf16>(), layout_.total_numel(), stream_);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
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
  std::vector<int64_t> positions;
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
  // The same host-built fp32 tables and taps as the reference, so both rotate and resample alike.
  positions.resize(static_cast<size_t>(N * 2));
  vision_rope_positions(grids.data(), num_images, m, positions.data());
  std::vector<float> cos(static_cast<size_t>(N * D / 2)), sin(cos.size());
  vision_rope_tables_ref(positions.data(), N, D, kVisionRopeTheta, cos.data(), sin.data());
  std::vector<int64_t> tap_index(static_cast<size_t>(N * 4));
  std::vector<float> tap_weight(static_cast<size_t>(N * 4));
  vision_pos_embed_taps(grids.data(), num_images, grid_side_, m, tap_index.data(), tap_weight.data());
  const int64_t table_rows = config_.num_position_embeddings;
  std::vector<int32_t> row_offsets(static_cast<size_t>(table_rows + 1)), entries(static_cast<size_t>(N * 4));
  vision_pos_embed_invert_taps(tap_index.data(), N, table_rows, row_offsets.data(), entries.data());

  auto upload = [&](void* device, const void* host, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_));
  };
  upload(pixels_f32_, pixel_values, static_cast<size_t>(N * K) * sizeof(float));
  convert_f32_to_bf16_cuda(pixels_f32_, pixels_, N * K, stream_);
  upload(cu_seqlens_, cu_seqlens.data(), cu_seqlens.size() * sizeof(int32_t));
  upload(rope_cos_, cos.data(), cos.size() * sizeof(float));
  upload(rope_sin_, sin.data(), sin.size() * sizeof(float));
  upload(tap_index_, tap_index.data(), tap_index.size() * sizeof(int64_t));
  upload(tap_weight_, tap_weight.data(), tap_weight.size() * sizeof(float));
  upload(tap_row_offsets_, row_offsets.data(), row_offsets.size() * sizeof(int32_t));
  upload(tap_entries_, entries.data(), entries.size() * sizeof(int32_t));
  num_patches_ = N;
  num_segments_ = segments;
  // Pageable host memory: wait for the copies so the vectors above may go.
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void GpuVisionModel::forward(Bf16* merged_out) {
  CHECK(num_patches_ > 0, "gpu vision model: forward called before set_images");
  CHECK(merged_out != nullptr, "gpu vision model: forward needs an output buffer");
  const int64_t N = num_patches_, C = config_.hidden_size, K = config_.patch_dim();
  const int64_t M = num_merged(), wide = config_.merged_dim(), O = config_.out_hidden_size;
  // Patch embedding: the Conv3d with kernel = stride is a product with the flattened weight [C, K].
  // The bf16 projection (with its bias) plus the fp32 position table starts the fp32 stream.
  linear_forward_bias_cuda(*gemm_, pixels_, weight(".patch_embed.proj.weight"), weight(".patch_embed.proj.bias"),
                           branch_out_, N, K, C, stream_);
  vision_pos_embed_forward_cuda(master_weight(".pos_embed.weight"), tap_index_, tap_weight_, branch_out_, embedded_, N,
                                C, stream_);
  for (int64_t j = 0; j < config_.depth; ++j)
    block_forward(j, j == 0 ? nullptr : branch_out_, j == 0 ? nullptr : blocks_[static_cast<size_t>(j - 1)].h1);

  // Merger: LayerNorm per patch (fused with the last block's residual add), then each run of m^2
  // patches is one row of [M, 4C]: fc1 + bias, exact GELU, fc2 + bias.
  if (config_.depth > 0) {
    layer_norm_forward_cuda(branch_out_, blocks_.back().h1, merger_in_, master_weight(".merger.norm.weight"),
                            master_weight(".merger.norm.bias"), merger_norm_, merger_mean_, merger_rstd_, N, C,
                            kLayerNormEps, stream_);
  } else {
    layer_norm_forward_cuda(nullptr, embedded_, nullptr, master_weight(".merger.norm.weight"),
                            master_weight(".merger.norm.bias"), merger_norm_, merger_mean_, merger_rstd_, N, C,
                            kLayerNormEps, stream_);
  }
  // Every linear with a bias rounds x W^T + b once (linear_forward_bias_cuda), as autocast does.
  linear_forward_bias_cuda(*gemm_, merger_norm_, weight(".merger.linear_fc1.weight"), weight(".merger.linear_fc1.bias"),
                           merger_fc1_, M, wide, wide, stream_);
  gelu_forward_cuda(GeluKind::exact, merger_fc1_, nullptr, nullptr, merger_act_, M, wide, stream_);
  linear_forward_bias_cuda(*gemm_, merger_act_, weight(".merger.linear_fc2.weight"), weight(".merger.linear_fc2.bias"),
                           merged_out, M, wide, O, stream_);
}

void GpuVisionModel::block_forward(int64_t block, const Bf16* prev_mlp_out, const float* prev_h1) {
  GpuVisionBlockBuffers& b = blocks_[static_cast<size_t>(block)];
  const int64_t N = num_patches_, C = config_.hidden_size, I = config_.intermediate_size;
  const int64_t H = config_.num_heads, D = config_.head_dim();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  auto w = [&](const char* leaf) { return weight(block_name(block, leaf)); };
  auto norm = [&](const char* leaf) { return master_weight(block_name(block, leaf)); };
  if (prev_mlp_out == nullptr) {
    layer_norm_forward_cuda(nullptr, b.x_in, nullptr, norm("norm1.weight"), norm("norm1.bias"), b.ln1, b.mean1,
                            b.rstd1, N, C, kLayerNormEps, stream_);
  } else {
    // x_in = previous h1 + previous MLP output (the previous block's residual add).
    layer_norm_forward_cuda(prev_mlp_out, prev_h1, b.x_in, norm("norm1.weight"), norm("norm1.bias"), b.ln1, b.mean1,
                            b.rstd1, N, C, kLayerNormEps, stream_);
  }
  linear_forward_bias_cuda(*gemm_, b.ln1, w("attn.qkv.weight"), w("attn.qkv.bias"), qkv_, N, C, 3 * C, stream_);
  // qkv rows are [q | k | v]; q and k are rotated out into the contiguous layout attention reads.
  vision_rope_forward_cuda(qkv_, 3 * C, b.q, C, rope_cos_, rope_sin_, N, H, D, stream_);
  vision_rope_forward_cuda(qkv_ + C, 3 * C, b.k, C, rope_cos_, rope_sin_, N, H, D, stream_);
  copy_columns(qkv_ + 2 * C, 3 * C, b.v, C, C, N, stream_);
  bidirectional_attention_forward_cuda(b.q, b.k, b.v, cu_seqlens_, num_segments_, b.attn, b.lse, N, H, D, scale,
                                       stream_);
  linear_forward_bias_cuda(*gemm_, b.attn, w("attn.proj.weight"), w("attn.proj.bias"), branch_out_, N, C, C, stream_);
  // h1 = x_in + proj, normalised in the same pass.
  layer_norm_forward_cuda(branch_out_, b.x_in, b.h1, norm("norm2.weight"), norm("norm2.bias"), b.ln2, b.mean2,
                          b.rstd2, N, C, kLayerNormEps, stream_);
  linear_forward_bias_cuda(*gemm_, b.ln2, w("mlp.linear_fc1.weight"), w("mlp.linear_fc1.bias"), b.fc1, N, C, I,
                           stream_);
  gelu_forward_cuda(block_gelu_kind(config_), b.fc1, nullptr, nullptr, b.act, N, I, stream_);
  linear_forward_bias_cuda(*gemm_, b.act, w("mlp.linear_fc2.weight"), w("mlp.linear_fc2.bias"), branch_out_, N, I, C,
                           stream_);
  // (branch_out_ + h1 is the next block's norm1 input, or the merger's.)
}

void GpuVisionModel::backward(const Bf16* d_merged, const TrainableParts& trainable) {
  CHECK(num_patches_ > 0, "gpu vision model: backward called before set_images");
  CUDA_CHECK(cudaMemsetAsync(grads_.data(), 0, grads_.bytes(), stream_));
  if (!trainable.vision()) return;
  CHECK(d_merged != nullptr, "gpu vision model: backward needs d_merged");
  const int64_t N = num_patches_, C = config_.hidden_size, K = config_.patch_dim();
  const int64_t M = num_merged(), wide = config_.merged_dim(), O = config_.out_hidden_size;
  void* ws = workspace_.data();
  const size_t ws_bytes = workspace_bytes_;
  const bool aligner = trainable.aligner;
  // A frozen merger's weight products are skipped (null gradients); its input gradient still
  // flows when the ViT trains.
  auto merger_grad = [&](const char* name) { return aligner ? grad(name) : nullptr; };

  if (aligner) {
    bias_add_backward_cuda(d_merged, grad(".merger.linear_fc2.bias"), M, O, ws, ws_bytes, stream_);
    linear_backward_weight_cuda(*gemm_, d_merged, merger_act_, grad(".merger.linear_fc2.weight"), M, wide, O, stream_);
  }
  Bf16* d_wide = grad_wide_;
  linear_backward_input_cuda(*gemm_, d_merged, weight(".merger.linear_fc2.weight"), d_wide, M, wide, O, stream_);
  gelu_backward_cuda(GeluKind::exact, merger_fc1_, d_wide, d_wide, merger_grad(".merger.linear_fc1.bias"), M, wide, ws,
                     ws_bytes, stream_);
  if (aligner)
    linear_backward_weight_cuda(*gemm_, d_wide, merger_norm_, grad(".merger.linear_fc1.weight"), M, wide, wide,
                                stream_);
  // The LayerNorm backward reads this product's fp32 accumulator unrounded.
  linear_backward_input_f32_cuda(*gemm_, d_wide, weight(".merger.linear_fc1.weight"), grad_norm_, false, M, wide, wide,
                                 stream_);
  const float* merger_x = config_.depth > 0 ? merger_in_ : embedded_;
  layer_norm_backward_cuda(merger_x, master_weight(".merger.norm.weight"), merger_mean_, merger_rstd_, grad_norm_,
                           nullptr, grad_stream_, grad_stream_bf16_, merger_grad(".merger.norm.weight"),
                           merger_grad(".merger.norm.bias"), N, C, ws, ws_bytes, stream_);
  if (!trainable.vit) return;  // nothing below the merger is trained

  for (int64_t j = config_.depth - 1; j >= 0; --j) block_backward(j);
  // grad_stream_: the gradient of the embedding (patch projection + bias + position embedding);
  // the fp32 table and the bias take it in fp32, the bf16 projection's weight its bf16 copy.
  vision_pos_embed_backward_cuda(grad_stream_, tap_weight_, tap_row_offsets_, tap_entries_, grad(".pos_embed.weight"),
                                 N, config_.num_position_embeddings, C, stream_);
  bias_add_backward_cuda(grad_stream_, grad(".patch_embed.proj.bias"), N, C, ws, ws_bytes, stream_);
  linear_backward_weight_cuda(*gemm_, grad_stream_bf16_, pixels_, grad(".patch_embed.proj.weight"), N, K, C, stream_);
}

void GpuVisionModel::block_backward(int64_t block) {
  const GpuVisionBlockBuffers& b = blocks_[static_cast<size_t>(block)];
  const int64_t N = num_patches_, C = config_.hidden_size, I = config_.intermediate_size;
  const int64_t H = config_.num_heads, D = config_.head_dim();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  void* ws = workspace_.data();
  const size_t ws_bytes = workspace_bytes_;
  auto w = [&](const char* leaf) { return weight(block_name(block, leaf)); };
  auto norm = [&](const char* leaf) { return master_weight(block_name(block, leaf)); };
  auto g = [&](const char* leaf) { return grad(block_name(block, leaf)); };
  const Bf16* d_out = grad_stream_bf16_;
  // MLP branch: d_out reaches both fc2 and, through the residual, h1.
  // Biases whose output joins the stream take their gradient from the fp32 stream gradient.
  bias_add_backward_cuda(grad_stream_, g("mlp.linear_fc2.bias"), N, C, ws, ws_bytes, stream_);
  linear_backward_input_cuda(*gemm_, d_out, w("mlp.linear_fc2.weight"), grad_wide_, N, I, C, stream_);
  linear_backward_weight_cuda(*gemm_, d_out, b.act, g("mlp.linear_fc2.weight"), N, I, C, stream_);
  gelu_backward_cuda(block_gelu_kind(config_), b.fc1, grad_wide_, grad_wide_, g("mlp.linear_fc1.bias"), N, I, ws,
                     ws_bytes, stream_);
  // The LayerNorm backward reads this product's fp32 accumulator unrounded.
  linear_backward_input_f32_cuda(*gemm_, grad_wide_, w("mlp.linear_fc1.weight"), grad_norm_, false, N, C, I, stream_);
  linear_backward_weight_cuda(*gemm_, grad_wide_, b.ln2, g("mlp.linear_fc1.weight"), N, C, I, stream_);
  layer_norm_backward_cuda(b.h1, norm("norm2.weight"), b.mean2, b.rstd2, grad_norm_, grad_stream_, grad_h1_,
                           grad_h1_bf16_, g("norm2.weight"), g("norm2.bias"), N, C, ws, ws_bytes, stream_);
  // Attention branch: the gradient reaching h1 reaches both proj and, through the residual, x_in.
  bias_add_backward_cuda(grad_h1_, g("attn.proj.bias"), N, C, ws, ws_bytes, stream_);
  linear_backward_input_cuda(*gemm_, grad_h1_bf16_, w("attn.proj.weight"), grad_attn_, N, C, C, stream_);
  linear_backward_weight_cuda(*gemm_, grad_h1_bf16_, b.attn, g("attn.proj.weight"), N, C, C, stream_);
  bidirectional_attention_backward_cuda(b.q, b.k, b.v, b.attn, b.lse, grad_attn_, cu_seqlens_, num_segments_, grad_q_,
                                        grad_k_, grad_v_, N, H, D, scale, ws, ws_bytes, stream_);
  // d_qkv [N, 3C] = [rope^-1(dq) | rope^-1(dk) | dv].
  Bf16* d_qkv = grad_wide_;
  vision_rope_backward_cuda(grad_q_, C, d_qkv, 3 * C, rope_cos_, rope_sin_, N, H, D, stream_);
  vision_rope_backward_cuda(grad_k_, C, d_qkv + C, 3 * C, rope_cos_, rope_sin_, N, H, D, stream_);
  copy_columns(grad_v_, C, d_qkv + 2 * C, 3 * C, C, N, stream_);
  bias_add_backward_cuda(d_qkv, g("attn.qkv.bias"), N, 3 * C, ws, ws_bytes, stream_);
  // The LayerNorm backward reads this product's fp32 accumulator unrounded.
  linear_backward_input_f32_cuda(*gemm_, d_qkv, w("attn.qkv.weight"), grad_norm_, false, N, C, 3 * C, stream_);
  linear_backward_weight_cuda(*gemm_, d_qkv, b.ln1, g("attn.qkv.weight"), N, C, 3 * C, stream_);
  // The stream gradient is free again (norm2's backward consumed it): it now receives the input's.
  layer_norm_backward_cuda(b.x_in, norm("norm1.weight"), b.mean1, b.rstd1, grad_norm_, grad_h1_, grad_stream_,
                           grad_stream_bf16_, g("norm1.weight"), g("norm1.bias"), N, C, ws, ws_bytes, stream_);
}

std::vector<float> GpuVisionModel::read_gradient(const std::string& name) const {
  const int index = layout_.find(name);
  CHECK(index >= 0, "gpu vision model: no parameter '", name, "'");
  const ParamEntry& e = layout_.entry(index);
  return download_f32(grads_.as<float>() + e.offset, e.numel, stream_);
}

std::vector<float> GpuVisionModel::read_master(const std::string& name) const {
  const int index = layout_.find(name);
  CHECK(index >= 0, "gpu vision model: no parameter '", name, "'");
  const ParamEntry& e = layout_.entry(index);
  return download_f32(master_.as<float>() + e.offset, e.numel, stream_);
}

}  // namespace deltamoe
