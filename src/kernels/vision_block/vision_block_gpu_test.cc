// Timing of one vision-tower block, forward and backward, at 8 images of 448x448 (6,272 patches,
// width 1152, 16 heads x 72, MLP 4304): the vision ops of this folder's siblings chained with the
// dense products (gemm/) and per-image attention (bidirectional_attention/), to show where the
// block's time goes. Checks only that the outputs are finite: each op has its own accuracy test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/bias_add/bias_add_cuda.h"
#include "kernels/bidirectional_attention/bidirectional_attention_cuda.h"
#include "kernels/gelu/gelu_cuda.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/layer_norm/layer_norm_cuda.h"
#include "kernels/vision_grid/vision_grid.h"
#include "kernels/vision_rope/vision_rope.h"
#include "kernels/vision_rope/vision_rope_cuda.h"

namespace deltamoe {
namespace {

constexpr int64_t kImages = 8, kGridSide = 28;  // 448 / 16 patches per side
constexpr int64_t kWidth = 1152, kHeads = 16, kHeadDim = 72, kMlp = 4304;
constexpr double kEps = 1e-6;

struct BlockWeights {
  DeviceTensor norm1_w, norm1_b, qkv_w, qkv_b, proj_w, proj_b, norm2_w, norm2_b, fc1_w, fc1_b, fc2_w, fc2_b;
};

struct BlockGrads {
  DeviceTensor norm1_w, norm1_b, qkv_w, qkv_b, proj_w, proj_b, norm2_w, norm2_b, fc1_w, fc1_b, fc2_w, fc2_b;
};

DeviceTensor f32_zeros(Shape shape) {
  DeviceTensor t = device_tensor(DType::f32, shape);
  device_fill_bytes(t.view, 0);
  return t;
}

bool all_finite(const DeviceTensor& t) {
  HostTensor host = to_host(t.view).to_f32();
  for (int64_t i = 0; i < host.numel(); ++i)
    if (!std::isfinite(host.as<float>()[i])) return false;
  return true;
}

TEST(VisionBlockGpu, TimingAtEightImagesOf448) {
  const int64_t n = kImages * kGridSide * kGridSide, hd = kHeads * kHeadDim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  std::printf("vision block N=%lld C=%lld H=%lld D=%lld MLP=%lld\n", static_cast<long long>(n),
              static_cast<long long>(kWidth), static_cast<long long>(kHeads), static_cast<long long>(kHeadDim),
              static_cast<long long>(kMlp));

  // Per-image segments and rope tables.
  std::vector<int64_t> grid_thw;
  std::vector<int32_t> cu_seqlens = {0};
  for (int64_t i = 0; i < kImages; ++i) {
    grid_thw.insert(grid_thw.end(), {1, kGridSide, kGridSide});
    cu_seqlens.push_back(cu_seqlens.back() + static_cast<int32_t>(kGridSide * kGridSide));
  }
  HostTensor positions(DType::i64, {n, 2});
  vision_rope_positions(grid_thw.data(), kImages, 2, positions.as<int64_t>());
  HostTensor cu_host(DType::i32, {kImages + 1});
  for (int64_t i = 0; i <= kImages; ++i) cu_host.as<int32_t>()[i] = cu_seqlens[static_cast<size_t>(i)];
  DeviceTensor positions_d = to_device(positions), cu_d = to_device(cu_host);
  DeviceTensor cos_d = device_tensor(DType::f32, {n, kHeadDim / 2});
  DeviceTensor sin_d = device_tensor(DType::f32, {n, kHeadDim / 2});
  vision_rope_tables_cuda(positions_d.view.as<int64_t>(), n, kHeadDim, 10000.0, f32_ptr(cos_d), f32_ptr(sin_d),
                          nullptr);

  // Norm weights and biases are fp32 (read from the master copy); the linear ones bf16.
  BlockWeights w{to_device(random_normal_tensor({kWidth}, 1, 0.1f), DType::f32),
                 to_device(random_normal_tensor({kWidth}, 2, 0.1f), DType::f32),
                 tiled_random_device_tensor({3 * kWidth, kWidth}, 3, 0.03f),
                 to_device(random_normal_tensor({3 * kWidth}, 4, 0.1f), DType::bf16),
                 tiled_random_device_tensor({kWidth, kWidth}, 5, 0.03f),
                 to_device(random_normal_tensor({kWidth}, 6, 0.1f), DType::bf16),
                 to_device(random_normal_tensor({kWidth}, 7, 0.1f), DType::f32),
                 to_device(random_normal_tensor({kWidth}, 8, 0.1f), DType::f32),
                 tiled_random_device_tensor({kMlp, kWidth}, 9, 0.03f),
                 to_device(random_normal_tensor({kMlp}, 10, 0.1f), DType::bf16),
                 tiled_random_device_tensor({kWidth, kMlp}, 11, 0.015f),
                 to_device(random_normal_tensor({kWidth}, 12, 0.1f), DType::bf16)};
  BlockGrads g{f32_zeros({kWidth}), f32_zeros({kWidth}), f32_zeros({3 * kWidth, kWidth}), f32_zeros({3 * kWidth}),
               f32_zeros({kWidth, kWidth}), f32_zeros({kWidth}), f32_zeros({kWidth}), f32_zeros({kWidth}),
               f32_zeros({kMlp, kWidth}), f32_zeros({kMlp}), f32_zeros({kWidth, kMlp}), f32_zeros({kWidth})};

  // Activations kept for the backward.
  DeviceTensor x = to_device(random_normal_tensor({n, kWidth}, 20), DType::f32);  // the fp32 residual stream
  DeviceTensor ln1 = device_tensor(DType::bf16, {n, kWidth});
  DeviceTensor mean1 = device_tensor(DType::f32, {n}), rstd1 = device_tensor(DType::f32, {n});
  DeviceTensor qkv = device_tensor(DType::bf16, {n, 3 * hd});
  DeviceTensor q = device_tensor(DType::bf16, {n, hd}), k = device_tensor(DType::bf16, {n, hd});
  DeviceTensor v = device_tensor(DType::bf16, {n, hd}), attn = device_tensor(DType::bf16, {n, hd});
  DeviceTensor lse = device_tensor(DType::f32, {n, kHeads});
  DeviceTensor proj = device_tensor(DType::bf16, {n, kWidth}), h1 = device_tensor(DType::f32, {n, kWidth});
  DeviceTensor ln2 = device_tensor(DType::bf16, {n, kWidth});
  DeviceTensor mean2 = device_tensor(DType::f32, {n}), rstd2 = device_tensor(DType::f32, {n});
  DeviceTensor fc1 = device_tensor(DType::bf16, {n, kMlp}), act = device_tensor(DType::bf16, {n, kMlp});
  DeviceTensor out = device_tensor(DType::bf16, {n, kWidth});
  // Gradients.
  DeviceTensor d_out = to_device(random_normal_tensor({n, kWidth}, 30, 1e-2f), DType::f32);
  DeviceTensor d_out_bf16 = to_device(random_normal_tensor({n, kWidth}, 30, 1e-2f), DType::bf16);
  DeviceTensor d_act = device_tensor(DType::bf16, {n, kMlp}), d_ln2 = device_tensor(DType::bf16, {n, kWidth});
  DeviceTensor d_h1 = device_tensor(DType::f32, {n, kWidth}), d_h1_bf16 = device_tensor(DType::bf16, {n, kWidth});
  DeviceTensor d_attn = device_tensor(DType::bf16, {n, hd});
  DeviceTensor dq = device_tensor(DType::bf16, {n, hd}), dk = device_tensor(DType::bf16, {n, hd});
  DeviceTensor dv = device_tensor(DType::bf16, {n, hd}), dqkv = device_tensor(DType::bf16, {n, 3 * hd});
  DeviceTensor d_ln1 = device_tensor(DType::bf16, {n, kWidth}), dx = device_tensor(DType::f32, {n, kWidth});
  DeviceTensor dx_bf16 = device_tensor(DType::bf16, {n, kWidth});

  size_t scratch_bytes = std::max({layer_norm_backward_workspace_bytes(n, kMlp),
                                   gelu_backward_workspace_bytes(n, kMlp, true),
                                   bias_add_backward_workspace_bytes(n, 3 * hd),
                                   bidirectional_attention_backward_workspace_bytes(n, kHeads)});
  DeviceBuffer scratch(scratch_bytes);
  GemmContext gemm;
  auto bf = [](const DeviceTensor& t) { return bf16_ptr(t); };

  // The vision ops alone (everything but the products and attention), to see their share.
  auto vision_ops_forward = [&](cudaStream_t s) {
    layer_norm_forward_cuda(nullptr, f32_ptr(x), nullptr, f32_ptr(w.norm1_w), f32_ptr(w.norm1_b), bf(ln1),
                            f32_ptr(mean1), f32_ptr(rstd1), n, kWidth, kEps, s);
    bias_add_forward_cuda(bf(w.qkv_b), bf(qkv), n, 3 * hd, s);
    vision_qkv_rope_forward_cuda(bf(qkv), 3 * hd, bf(q), bf(k), bf(v), f32_ptr(cos_d), f32_ptr(sin_d), n, kHeads,
                                 kHeadDim, 0, s);
    bias_add_forward_cuda(bf(w.proj_b), bf(proj), n, kWidth, s);
    layer_norm_forward_cuda(bf(proj), f32_ptr(x), f32_ptr(h1), f32_ptr(w.norm2_w), f32_ptr(w.norm2_b), bf(ln2),
                            f32_ptr(mean2), f32_ptr(rstd2), n, kWidth, kEps, s);
    gelu_forward_cuda(GeluKind::tanh, bf(fc1), bf(w.fc1_b), bf(fc1), bf(act), n, kMlp, s);
    bias_add_forward_cuda(bf(w.fc2_b), bf(out), n, kWidth, s);
  };

  auto block_forward = [&](cudaStream_t s) {
    layer_norm_forward_cuda(nullptr, f32_ptr(x), nullptr, f32_ptr(w.norm1_w), f32_ptr(w.norm1_b), bf(ln1),
                            f32_ptr(mean1), f32_ptr(rstd1), n, kWidth, kEps, s);
    linear_forward_cuda(gemm, bf(ln1), bf(w.qkv_w), bf(qkv), DType::bf16, n, kWidth, 3 * hd, s);
    bias_add_forward_cuda(bf(w.qkv_b), bf(qkv), n, 3 * hd, s);
    // q and k rotated out of the fused qkv output into the contiguous layout attention reads, v copied.
    vision_qkv_rope_forward_cuda(bf(qkv), 3 * hd, bf(q), bf(k), bf(v), f32_ptr(cos_d), f32_ptr(sin_d), n, kHeads,
                                 kHeadDim, 0, s);
    bidirectional_attention_forward_cuda(bf(q), bf(k), bf(v), cu_d.view.as<int32_t>(), kImages, bf(attn),
                                         f32_ptr(lse), n, kHeads, kHeadDim, scale, s);
    linear_forward_cuda(gemm, bf(attn), bf(w.proj_w), bf(proj), DType::bf16, n, hd, kWidth, s);
    bias_add_forward_cuda(bf(w.proj_b), bf(proj), n, kWidth, s);
    // h1 = x + proj, normalised in the same pass.
    layer_norm_forward_cuda(bf(proj), f32_ptr(x), f32_ptr(h1), f32_ptr(w.norm2_w), f32_ptr(w.norm2_b), bf(ln2),
                            f32_ptr(mean2), f32_ptr(rstd2), n, kWidth, kEps, s);
    linear_forward_cuda(gemm, bf(ln2), bf(w.fc1_w), bf(fc1), DType::bf16, n, kWidth, kMlp, s);
    gelu_forward_cuda(GeluKind::tanh, bf(fc1), bf(w.fc1_b), bf(fc1), bf(act), n, kMlp, s);
    linear_forward_cuda(gemm, bf(act), bf(w.fc2_w), bf(out), DType::bf16, n, kMlp, kWidth, s);
    bias_add_forward_cuda(bf(w.fc2_b), bf(out), n, kWidth, s);
    // (out + h1 is the next block's fused norm1 input.)
  };

  auto block_backward = [&](cudaStream_t s) {
    void* ws = scratch.data();
    const size_t ws_bytes = scratch.bytes();
    // fc2 (its output joins the residual stream: d_out reaches both fc2 and h1).
    // The branch products read the bf16 copy of the stream gradient; norm2's backward sums the fp32
    // stream gradients into the biases of fc2 (the one it reads) and proj (the one it writes).
    linear_backward_input_cuda(gemm, bf(d_out_bf16), bf(w.fc2_w), bf(d_act), n, kMlp, kWidth, s);
    linear_backward_weight_cuda(gemm, bf(d_out_bf16), bf(act), f32_ptr(g.fc2_w), n, kMlp, kWidth, s);
    gelu_backward_cuda(GeluKind::tanh, bf(fc1), bf(d_act), bf(d_act), f32_ptr(g.fc1_b), n, kMlp, ws, ws_bytes, s);
    linear_backward_input_cuda(gemm, bf(d_act), bf(w.fc1_w), bf(d_ln2), n, kWidth, kMlp, s);
    linear_backward_weight_cuda(gemm, bf(d_act), bf(ln2), f32_ptr(g.fc1_w), n, kWidth, kMlp, s);
    layer_norm_backward_cuda(f32_ptr(h1), f32_ptr(w.norm2_w), f32_ptr(mean2), f32_ptr(rstd2), bf(d_ln2),
                             f32_ptr(d_out), f32_ptr(d_h1), bf(d_h1_bf16), f32_ptr(g.norm2_w), f32_ptr(g.norm2_b),
                             {.of_d_skip = f32_ptr(g.fc2_b), .of_dx = f32_ptr(g.proj_b)}, n, kWidth, ws, ws_bytes, s);
    linear_backward_input_cuda(gemm, bf(d_h1_bf16), bf(w.proj_w), bf(d_attn), n, hd, kWidth, s);
    linear_backward_weight_cuda(gemm, bf(d_h1_bf16), bf(attn), f32_ptr(g.proj_w), n, hd, kWidth, s);
    bidirectional_attention_backward_cuda(bf(q), bf(k), bf(v), bf(attn), f32_ptr(lse), bf(d_attn),
                                          cu_d.view.as<int32_t>(), kImages, bf(dq), bf(dk), bf(dv), n, kHeads,
                                          kHeadDim, scale, ws, ws_bytes, s);
    vision_qkv_rope_backward_cuda(bf(dq), bf(dk), bf(dv), bf(dqkv), 3 * hd, f32_ptr(cos_d), f32_ptr(sin_d), n, kHeads,
                                  kHeadDim, 0, s);
    bias_add_backward_cuda(bf(dqkv), f32_ptr(g.qkv_b), n, 3 * hd, ws, ws_bytes, s);
    linear_backward_input_cuda(gemm, bf(dqkv), bf(w.qkv_w), bf(d_ln1), n, kWidth, 3 * hd, s);
    linear_backward_weight_cuda(gemm, bf(dqkv), bf(ln1), f32_ptr(g.qkv_w), n, kWidth, 3 * hd, s);
    layer_norm_backward_cuda(f32_ptr(x), f32_ptr(w.norm1_w), f32_ptr(mean1), f32_ptr(rstd1), bf(d_ln1), f32_ptr(d_h1),
                             f32_ptr(dx), bf(dx_bf16), f32_ptr(g.norm1_w), f32_ptr(g.norm1_b), {}, n, kWidth, ws,
                             ws_bytes, s);
  };

  block_forward(nullptr);
  block_backward(nullptr);
  device_synchronize();
  EXPECT_TRUE(all_finite(out)) << "block output";
  EXPECT_TRUE(all_finite(dx)) << "block input gradient";
  EXPECT_TRUE(all_finite(g.qkv_w)) << "qkv weight gradient";

  const double linear_flops = 2.0 * n * kWidth * (3.0 * hd + hd + 2.0 * kMlp);
  const double attention_flops = 4.0 * kImages * std::pow(kGridSide * kGridSide, 2) * kHeads * kHeadDim;
  const double fwd = median_ms(block_forward, nullptr);
  print_flop_timing("vision block fwd (linear + attention FLOPs)", fwd, linear_flops + attention_flops);
  // Backward: two products per linear, 2.5x the forward's attention work (dQ, dK, dV, dP, recompute S).
  const double bwd = median_ms(block_backward, nullptr);
  print_flop_timing("vision block bwd (linear + attention FLOPs)", bwd, 2 * linear_flops + 2.5 * attention_flops);
  const double ops = median_ms(vision_ops_forward, nullptr);
  std::printf("  TIMING %-44s %9.3f ms  (%.0f%% of the block forward)\n", "vision ops of the block fwd (no GEMM/attn)",
              ops, 100.0 * ops / fwd);
  std::printf("  TIMING %-44s %9.3f ms  (27 blocks, fwd + bwd)\n", "tower estimate", 27 * (fwd + bwd));
}

}  // namespace
}  // namespace deltamoe
