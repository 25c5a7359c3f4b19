// GPU test of the 2-D vision RoPE: tables from (row, col) positions; the fused qkv rows split into
// q and k rotated (heads zero-padded past D where asked) and v copied, and the backward rotating dq
// and dk back (their pad columns poisoned, so a read of them would show) beside dv into the fused
// gradient rows, against the fp32 references; every vector width (4, 2 and 1 values an access);
// timing at 8 images of 448x448 (16 heads x 72, padded to 80 as the tower runs it).
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/vision_grid/vision_grid.h"
#include "kernels/vision_rope/vision_rope.h"
#include "kernels/vision_rope/vision_rope_cuda.h"

namespace deltamoe {
namespace {

constexpr int64_t kMergeSize = 2;
constexpr double kTheta = 10000.0;  // the vision tower's rope theta

HostTensor positions_for(const std::vector<int64_t>& grid_thw) {
  const int64_t images = static_cast<int64_t>(grid_thw.size()) / 3;
  HostTensor positions(DType::i64, {vision_num_patches(grid_thw.data(), images), 2});
  vision_rope_positions(grid_thw.data(), images, kMergeSize, positions.as<int64_t>());
  return positions;
}

// Copies heads [first, first + count) of every patch out of a [N, stride] buffer into [N, count, D].
HostTensor take_heads(const HostTensor& buffer, int64_t stride, int64_t first, int64_t count, int64_t head_dim) {
  const int64_t patches = buffer.shape()[0];
  HostTensor out(DType::f32, {patches, count, head_dim});
  const float* src = buffer.as<float>();
  for (int64_t n = 0; n < patches; ++n)
    for (int64_t i = 0; i < count * head_dim; ++i)
      out.as<float>()[n * count * head_dim + i] = src[n * stride + first * head_dim + i];
  return out;
}

// [N, H, D] heads laid into [N, H, padded] with `fill` in the columns past D.
HostTensor pad_heads(const HostTensor& heads_tensor, int64_t heads, int64_t head_dim, int64_t padded, float fill) {
  const int64_t patches = heads_tensor.shape()[0];
  HostTensor out(DType::f32, {patches, heads, padded});
  for (int64_t r = 0; r < patches * heads; ++r)
    for (int64_t d = 0; d < padded; ++d)
      out.as<float>()[r * padded + d] = d < head_dim ? heads_tensor.as<float>()[r * head_dim + d] : fill;
  return out;
}

// Forward and backward through one layout: qkv rows `stride` apart (>= 3 * H * D; the columns past
// 3 * H * D of the gradient rows hold values the backward must leave alone), q and k heads `padded`
// apart.
void check_qkv_rope(const std::vector<int64_t>& grid_thw, int64_t heads, int64_t head_dim, int64_t padded,
                    int64_t stride, uint64_t seed) {
  HostTensor positions = positions_for(grid_thw);
  const int64_t patches = positions.shape()[0], half = head_dim / 2, width = heads * head_dim;
  std::printf("vision_qkv_rope N=%lld H=%lld D=%lld Dqk=%lld stride=%lld images=%zu\n",
              static_cast<long long>(patches), static_cast<long long>(heads), static_cast<long long>(head_dim),
              static_cast<long long>(padded), static_cast<long long>(stride), grid_thw.size() / 3);
  HostTensor cos_ref(DType::f32, {patches, half}), sin_ref(DType::f32, {patches, half});
  vision_rope_tables_ref(positions.as<int64_t>(), patches, head_dim, kTheta, cos_ref.as<float>(), sin_ref.as<float>());

  HostTensor qkv = random_bf16_exact({patches, stride}, seed);
  HostTensor d_qkv_before = random_bf16_exact({patches, stride}, seed + 1);
  HostTensor q = take_heads(qkv, stride, 0, heads, head_dim), k = take_heads(qkv, stride, heads, heads, head_dim);
  HostTensor v = take_heads(qkv, stride, 2 * heads, heads, head_dim);
  HostTensor dq = random_bf16_exact({patches, heads, head_dim}, seed + 2);
  HostTensor dk = random_bf16_exact({patches, heads, head_dim}, seed + 3);
  HostTensor dv = random_bf16_exact({patches, heads, head_dim}, seed + 4);
  HostTensor q_ref(DType::f32, {patches, heads, head_dim}), k_ref(DType::f32, {patches, heads, head_dim});
  HostTensor dq_ref(DType::f32, {patches, heads, head_dim}), dk_ref(DType::f32, {patches, heads, head_dim});
  vision_rope_forward_ref(q.as<float>(), cos_ref.as<float>(), sin_ref.as<float>(), q_ref.as<float>(), patches, heads,
                          head_dim);
  vision_rope_forward_ref(k.as<float>(), cos_ref.as<float>(), sin_ref.as<float>(), k_ref.as<float>(), patches, heads,
                          head_dim);
  vision_rope_backward_ref(dq.as<float>(), cos_ref.as<float>(), sin_ref.as<float>(), dq_ref.as<float>(), patches,
                           heads, head_dim);
  vision_rope_backward_ref(dk.as<float>(), cos_ref.as<float>(), sin_ref.as<float>(), dk_ref.as<float>(), patches,
                           heads, head_dim);

  DeviceTensor positions_d = to_device(positions);
  DeviceTensor cos_d = poisoned_device_tensor(DType::f32, {patches, half});
  DeviceTensor sin_d = poisoned_device_tensor(DType::f32, {patches, half});
  vision_rope_tables_cuda(positions_d.view.as<int64_t>(), patches, head_dim, kTheta, f32_ptr(cos_d), f32_ptr(sin_d),
                          nullptr);
  DeviceTensor qkv_d = to_device(qkv, DType::bf16);
  DeviceTensor q_d = poisoned_device_tensor(DType::bf16, {patches, heads, padded});
  DeviceTensor k_d = poisoned_device_tensor(DType::bf16, {patches, heads, padded});
  DeviceTensor v_d = poisoned_device_tensor(DType::bf16, {patches, heads, head_dim});
  vision_qkv_rope_forward_cuda(bf16_ptr(qkv_d), stride, bf16_ptr(q_d), bf16_ptr(k_d), bf16_ptr(v_d), f32_ptr(cos_d),
                               f32_ptr(sin_d), patches, heads, head_dim, padded, nullptr);
  // The backward's gradients in padded heads whose pad columns are NaN.
  const float nan = std::nanf("");
  DeviceTensor dq_d = to_device(pad_heads(dq, heads, head_dim, padded, nan), DType::bf16);
  DeviceTensor dk_d = to_device(pad_heads(dk, heads, head_dim, padded, nan), DType::bf16);
  DeviceTensor dv_d = to_device(dv, DType::bf16), d_qkv_d = to_device(d_qkv_before, DType::bf16);
  vision_qkv_rope_backward_cuda(bf16_ptr(dq_d), bf16_ptr(dk_d), bf16_ptr(dv_d), bf16_ptr(d_qkv_d), stride,
                                f32_ptr(cos_d), f32_ptr(sin_d), patches, heads, head_dim, padded, nullptr);
  device_synchronize();

  expect_close("cos (f32)", cos_d, cos_ref, 1e-5);  // cosf/sinf vs libm on the same fp32 angles
  expect_close("sin (f32)", sin_d, sin_ref, 1e-5);
  expect_close("q rotated (bf16)", q_d, pad_heads(q_ref, heads, head_dim, padded, 0.0f), 1e-2);
  expect_close("k rotated (bf16)", k_d, pad_heads(k_ref, heads, head_dim, padded, 0.0f), 1e-2);
  // Pad columns exactly zero (the outputs started as NaN).
  for (const DeviceTensor* t : {&q_d, &k_d}) {
    const HostTensor got = to_host(t->view).to_f32();
    int64_t bad_pads = 0;
    for (int64_t r = 0; r < patches * heads; ++r)
      for (int64_t d = head_dim; d < padded; ++d) bad_pads += got.as<float>()[r * padded + d] != 0.0f;
    EXPECT_EQ(bad_pads, 0) << "pad columns not written as zeros";
  }
  EXPECT_EQ(compare_tensors("v copied (bf16)", to_host(v_d.view).to_f32(), v).max_abs_diff, 0.0);

  const HostTensor d_qkv = to_host(d_qkv_d.view).to_f32();
  for (auto [name, first, ref] : {std::tuple{"dq rotated back into d_qkv (bf16)", int64_t{0}, &dq_ref},
                                  std::tuple{"dk rotated back into d_qkv (bf16)", heads, &dk_ref}}) {
    CompareResult r = compare_tensors(name, take_heads(d_qkv, stride, first, heads, head_dim), *ref);
    EXPECT_TRUE(r.all_finite) << name;
    EXPECT_LE(r.rel_l2, 1e-2) << name;
  }
  EXPECT_EQ(compare_tensors("dv copied into d_qkv", take_heads(d_qkv, stride, 2 * heads, heads, head_dim), dv)
                .max_abs_diff,
            0.0);
  // Columns past the three parts untouched.
  int64_t changed = 0;
  for (int64_t n = 0; n < patches; ++n)
    for (int64_t c = 3 * width; c < stride; ++c)
      changed += d_qkv.as<float>()[n * stride + c] != d_qkv_before.as<float>()[n * stride + c];
  EXPECT_EQ(changed, 0) << "d_qkv columns past 3 * H * D written";
}

TEST(VisionRopeGpu, MatchesReference) {
  check_qkv_rope({1, 2, 2}, 1, 4, 4, 12, 10);                        // smallest head: 2 values an access
  check_qkv_rope({2, 4, 6}, 3, 8, 8, 72, 20);                        // 2 temporal slices, odd head count
  check_qkv_rope({1, 32, 32}, 16, 72, 80, 3 * 16 * 72, 30);          // the tower's heads, padded for cuDNN
  check_qkv_rope({1, 64, 48, 1, 32, 32, 1, 2, 2}, 16, 72, 72, 3 * 16 * 72, 40);  // several images, no padding
  check_qkv_rope({1, 8, 6}, 4, 12, 16, 3 * 4 * 12 + 4, 50);          // rows wider than the three parts
}

// An odd row stride: one value an access (the pairs are not 4-byte aligned).
TEST(VisionRopeGpu, UnalignedRowsTakeTheScalarPath) {
  check_qkv_rope({1, 6, 4}, 2, 12, 12, 3 * 2 * 12 + 1, 60);
  check_qkv_rope({1, 6, 4}, 2, 12, 16, 3 * 2 * 12 + 1, 70);
}

TEST(VisionRopeGpu, BadArgumentsAreRejected) {
  DeviceTensor t = device_tensor(DType::bf16, {4, 3 * 72});
  DeviceTensor f = device_tensor(DType::f32, {4, 36});
  // head_dim not a multiple of 4
  EXPECT_THROW(vision_qkv_rope_forward_cuda(bf16_ptr(t), 210, bf16_ptr(t), bf16_ptr(t), bf16_ptr(t), f32_ptr(f),
                                            f32_ptr(f), 4, 1, 70, 0, nullptr),
               Error);
  // row stride shorter than q, k and v
  EXPECT_THROW(vision_qkv_rope_forward_cuda(bf16_ptr(t), 3 * 72, bf16_ptr(t), bf16_ptr(t), bf16_ptr(t), f32_ptr(f),
                                            f32_ptr(f), 4, 2, 72, 0, nullptr),
               Error);
  // q/k heads narrower than D
  EXPECT_THROW(vision_qkv_rope_backward_cuda(bf16_ptr(t), bf16_ptr(t), bf16_ptr(t), bf16_ptr(t), 3 * 72, f32_ptr(f),
                                             f32_ptr(f), 2, 1, 72, 64, nullptr),
               Error);
  EXPECT_THROW(vision_rope_tables_cuda(nullptr, 4, 72, -1.0, f32_ptr(f), f32_ptr(f), nullptr), Error);
}

TEST(VisionRopeGpu, TimingAtVisionShapes) {
  std::vector<int64_t> grid_thw;
  for (int i = 0; i < 8; ++i) grid_thw.insert(grid_thw.end(), {1, 28, 28});  // 8 images of 448x448, patch 16
  HostTensor positions = positions_for(grid_thw);
  const int64_t patches = positions.shape()[0], heads = 16, head_dim = 72, padded = 80, width = heads * head_dim;
  DeviceTensor positions_d = to_device(positions);
  DeviceTensor cos_d = device_tensor(DType::f32, {patches, head_dim / 2});
  DeviceTensor sin_d = device_tensor(DType::f32, {patches, head_dim / 2});
  DeviceTensor qkv = tiled_random_device_tensor({patches, 3 * width}, 1, 1.0f);
  DeviceTensor q = device_tensor(DType::bf16, {patches, heads, padded});
  DeviceTensor k = device_tensor(DType::bf16, {patches, heads, padded});
  DeviceTensor v = device_tensor(DType::bf16, {patches, width});
  double tables = median_ms([&](cudaStream_t s) {
    vision_rope_tables_cuda(positions_d.view.as<int64_t>(), patches, head_dim, kTheta, f32_ptr(cos_d), f32_ptr(sin_d),
                            s);
  }, nullptr);
  print_bandwidth_timing("vision_rope tables 6272x36", tables, static_cast<double>(patches) * head_dim * 4);
  // The fused rows read (written), q and k padded and v written (read), the tables read.
  const double bytes =
      2.0 * patches * (3 * width + 2 * heads * padded + width) + static_cast<double>(patches) * head_dim * 4;
  double fwd = median_ms([&](cudaStream_t s) {
    vision_qkv_rope_forward_cuda(bf16_ptr(qkv), 3 * width, bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), f32_ptr(cos_d),
                                 f32_ptr(sin_d), patches, heads, head_dim, padded, s);
  }, nullptr);
  print_bandwidth_timing("vision_qkv_rope 6272x16x72 (q, k padded to 80) fwd", fwd, bytes);
  double bwd = median_ms([&](cudaStream_t s) {
    vision_qkv_rope_backward_cuda(bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), bf16_ptr(qkv), 3 * width, f32_ptr(cos_d),
                                  f32_ptr(sin_d), patches, heads, head_dim, padded, s);
  }, nullptr);
  print_bandwidth_timing("vision_qkv_rope 6272x16x72 (q, k padded to 80) bwd", bwd, bytes);
}

}  // namespace
}  // namespace deltamoe
