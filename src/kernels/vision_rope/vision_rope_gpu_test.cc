// GPU test of the 2-D vision RoPE: tables from (row, col) positions, rotation of q and k in place
// inside a fused [N, 3, H, D] qkv buffer (v untouched), a strided out-of-place scalar path, and the
// inverse rotation, heads padded to 80 (zeros written past 72; the backward reading padded heads),
// against the fp32 references; timing at 8 images of 448x448 (16 heads x 72).
#include <gtest/gtest.h>

#include <cmath>
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

void check_vision_rope(const std::vector<int64_t>& grid_thw, int64_t heads, int64_t head_dim, uint64_t seed) {
  HostTensor positions = positions_for(grid_thw);
  const int64_t patches = positions.shape()[0], half = head_dim / 2, qkv_stride = 3 * heads * head_dim;
  std::printf("vision_rope N=%lld H=%lld D=%lld images=%zu\n", static_cast<long long>(patches),
              static_cast<long long>(heads), static_cast<long long>(head_dim), grid_thw.size() / 3);
  HostTensor cos_ref(DType::f32, {patches, half}), sin_ref(DType::f32, {patches, half});
  vision_rope_tables_ref(positions.as<int64_t>(), patches, head_dim, kTheta, cos_ref.as<float>(), sin_ref.as<float>());

  HostTensor qkv = random_bf16_exact({patches, qkv_stride}, seed);
  HostTensor dqkv = random_bf16_exact({patches, qkv_stride}, seed + 1);
  HostTensor q = take_heads(qkv, qkv_stride, 0, heads, head_dim);
  HostTensor k = take_heads(qkv, qkv_stride, heads, heads, head_dim);
  HostTensor v = take_heads(qkv, qkv_stride, 2 * heads, heads, head_dim);
  HostTensor dq = take_heads(dqkv, qkv_stride, 0, heads, head_dim);
  HostTensor q_ref(DType::f32, {patches, heads, head_dim}), k_ref(DType::f32, {patches, heads, head_dim});
  HostTensor dq_ref(DType::f32, {patches, heads, head_dim});
  vision_rope_forward_ref(q.as<float>(), cos_ref.as<float>(), sin_ref.as<float>(), q_ref.as<float>(), patches, heads,
                          head_dim);
  vision_rope_forward_ref(k.as<float>(), cos_ref.as<float>(), sin_ref.as<float>(), k_ref.as<float>(), patches, heads,
                          head_dim);
  vision_rope_backward_ref(dq.as<float>(), cos_ref.as<float>(), sin_ref.as<float>(), dq_ref.as<float>(), patches,
                           heads, head_dim);

  DeviceTensor positions_d = to_device(positions);
  DeviceTensor cos_d = poisoned_device_tensor(DType::f32, {patches, half});
  DeviceTensor sin_d = poisoned_device_tensor(DType::f32, {patches, half});
  DeviceTensor qkv_d = to_device(qkv, DType::bf16), dqkv_d = to_device(dqkv, DType::bf16);
  vision_rope_tables_cuda(positions_d.view.as<int64_t>(), patches, head_dim, kTheta, f32_ptr(cos_d), f32_ptr(sin_d),
                          nullptr);
  // q and k heads rotated in place in the qkv buffer, one launch.
  vision_rope_forward_cuda(bf16_ptr(qkv_d), qkv_stride, bf16_ptr(qkv_d), qkv_stride, f32_ptr(cos_d), f32_ptr(sin_d),
                           patches, 2 * heads, head_dim, nullptr);
  // Backward of q only (heads 0..H-1), in place in the gradient buffer.
  vision_rope_backward_cuda(bf16_ptr(dqkv_d), qkv_stride, bf16_ptr(dqkv_d), qkv_stride, f32_ptr(cos_d),
                            f32_ptr(sin_d), patches, heads, head_dim, nullptr);
  device_synchronize();

  expect_close("cos (f32)", cos_d, cos_ref, 1e-5);  // cosf/sinf vs libm on the same fp32 angles
  expect_close("sin (f32)", sin_d, sin_ref, 1e-5);
  HostTensor qkv_got = to_host(qkv_d.view).to_f32(), dqkv_got = to_host(dqkv_d.view).to_f32();
  CompareResult rq = compare_tensors("q rotated in qkv (bf16)", take_heads(qkv_got, qkv_stride, 0, heads, head_dim),
                                     q_ref);
  CompareResult rk = compare_tensors("k rotated in qkv (bf16)",
                                     take_heads(qkv_got, qkv_stride, heads, heads, head_dim), k_ref);
  CompareResult rv = compare_tensors("v untouched (bf16)", take_heads(qkv_got, qkv_stride, 2 * heads, heads, head_dim),
                                     v);
  CompareResult rdq = compare_tensors("dq inverse rotation (bf16)",
                                      take_heads(dqkv_got, qkv_stride, 0, heads, head_dim), dq_ref);
  CompareResult rdk = compare_tensors("dk untouched by a q-only backward",
                                      take_heads(dqkv_got, qkv_stride, heads, heads, head_dim),
                                      take_heads(dqkv, qkv_stride, heads, heads, head_dim));
  for (const CompareResult* r : {&rq, &rk, &rdq}) {
    EXPECT_TRUE(r->all_finite);
    EXPECT_LE(r->rel_l2, 1e-2);
  }
  EXPECT_EQ(rv.max_abs_diff, 0.0);
  EXPECT_EQ(rdk.max_abs_diff, 0.0);
}

TEST(VisionRopeGpu, MatchesReferenceInPlaceInQkv) {
  check_vision_rope({1, 2, 2}, 1, 4, 10);                    // one merge block, smallest head
  check_vision_rope({2, 4, 6}, 3, 8, 20);                    // 2 temporal slices, odd head count
  check_vision_rope({1, 32, 32}, 16, 72, 30);                // real heads, 32x32 patches
  check_vision_rope({1, 64, 48, 1, 32, 32, 1, 2, 2}, 16, 72, 40);  // several images packed
}

// Out of place with an odd patch stride: the scalar (one pair per thread) path.
TEST(VisionRopeGpu, StridedScalarPathMatchesReference) {
  const std::vector<int64_t> grid_thw = {1, 6, 4};
  HostTensor positions = positions_for(grid_thw);
  const int64_t patches = positions.shape()[0], heads = 2, head_dim = 12, half = head_dim / 2;
  const int64_t stride = heads * head_dim + 1;
  std::printf("vision_rope strided N=%lld stride=%lld\n", static_cast<long long>(patches),
              static_cast<long long>(stride));
  HostTensor cos_ref(DType::f32, {patches, half}), sin_ref(DType::f32, {patches, half});
  vision_rope_tables_ref(positions.as<int64_t>(), patches, head_dim, kTheta, cos_ref.as<float>(), sin_ref.as<float>());
  HostTensor x = random_bf16_exact({patches, stride}, 50);
  HostTensor x_heads = take_heads(x, stride, 0, heads, head_dim);
  HostTensor y_ref(DType::f32, {patches, heads, head_dim}), dx_ref(DType::f32, {patches, heads, head_dim});
  vision_rope_forward_ref(x_heads.as<float>(), cos_ref.as<float>(), sin_ref.as<float>(), y_ref.as<float>(), patches,
                          heads, head_dim);
  vision_rope_backward_ref(x_heads.as<float>(), cos_ref.as<float>(), sin_ref.as<float>(), dx_ref.as<float>(), patches,
                           heads, head_dim);
  DeviceTensor x_d = to_device(x, DType::bf16), cos_d = to_device(cos_ref), sin_d = to_device(sin_ref);
  DeviceTensor y_d = poisoned_device_tensor(DType::bf16, {patches, stride});
  DeviceTensor dx_d = poisoned_device_tensor(DType::bf16, {patches, heads, head_dim});
  vision_rope_forward_cuda(bf16_ptr(x_d), stride, bf16_ptr(y_d), stride, f32_ptr(cos_d), f32_ptr(sin_d), patches,
                           heads, head_dim, nullptr);
  vision_rope_backward_cuda(bf16_ptr(x_d), stride, bf16_ptr(dx_d), heads * head_dim, f32_ptr(cos_d), f32_ptr(sin_d),
                            patches, heads, head_dim, nullptr);
  device_synchronize();
  HostTensor y_got = take_heads(to_host(y_d.view).to_f32(), stride, 0, heads, head_dim);
  CompareResult ry = compare_tensors("y strided (bf16)", y_got, y_ref);
  EXPECT_TRUE(ry.all_finite);
  EXPECT_LE(ry.rel_l2, 1e-2);
  expect_close("dx contiguous (bf16)", dx_d, dx_ref, 1e-2);
}

// q out of the qkv buffer into heads padded to 80 (as the tower writes q and k for cuDNN's
// attention): the rotated values in each head's first 72 columns, zeros in the rest (the output
// starts poisoned); and the backward reading gradients from heads padded to 80 (the pad columns
// poisoned, so a read of them would show) into [N, H, 72].
TEST(VisionRopeGpu, PaddedHeadsMatchReference) {
  const std::vector<int64_t> grid_thw = {1, 8, 6, 1, 4, 4};
  HostTensor positions = positions_for(grid_thw);
  const int64_t patches = positions.shape()[0], heads = 16, head_dim = 72, padded = 80, half = head_dim / 2;
  const int64_t qkv_stride = 3 * heads * head_dim;
  HostTensor cos_ref(DType::f32, {patches, half}), sin_ref(DType::f32, {patches, half});
  vision_rope_tables_ref(positions.as<int64_t>(), patches, head_dim, kTheta, cos_ref.as<float>(), sin_ref.as<float>());
  HostTensor qkv = random_bf16_exact({patches, qkv_stride}, 60);
  HostTensor q = take_heads(qkv, qkv_stride, 0, heads, head_dim);
  HostTensor q_ref(DType::f32, {patches, heads, head_dim}), dx_ref(DType::f32, {patches, heads, head_dim});
  vision_rope_forward_ref(q.as<float>(), cos_ref.as<float>(), sin_ref.as<float>(), q_ref.as<float>(), patches, heads,
                          head_dim);
  // The backward's input: q's values (any values do) in heads padded with NaN.
  HostTensor dy_padded(DType::f32, {patches, heads, padded});
  for (int64_t r = 0; r < patches * heads; ++r)
    for (int64_t d = 0; d < padded; ++d)
      dy_padded.as<float>()[r * padded + d] = d < head_dim ? q.as<float>()[r * head_dim + d] : std::nanf("");
  vision_rope_backward_ref(q.as<float>(), cos_ref.as<float>(), sin_ref.as<float>(), dx_ref.as<float>(), patches, heads,
                           head_dim);
  DeviceTensor qkv_d = to_device(qkv, DType::bf16), cos_d = to_device(cos_ref), sin_d = to_device(sin_ref);
  DeviceTensor y_d = poisoned_device_tensor(DType::bf16, {patches, heads, padded});
  DeviceTensor dy_d = to_device(dy_padded, DType::bf16);
  DeviceTensor dx_d = poisoned_device_tensor(DType::bf16, {patches, heads, head_dim});
  vision_rope_forward_cuda(bf16_ptr(qkv_d), qkv_stride, bf16_ptr(y_d), heads * padded, f32_ptr(cos_d), f32_ptr(sin_d),
                           patches, heads, head_dim, nullptr, padded);
  vision_rope_backward_cuda(bf16_ptr(dy_d), heads * padded, bf16_ptr(dx_d), heads * head_dim, f32_ptr(cos_d),
                            f32_ptr(sin_d), patches, heads, head_dim, nullptr, padded);
  device_synchronize();
  const HostTensor y = to_host(y_d.view).to_f32();
  HostTensor y_rows(DType::f32, {patches, heads, head_dim});
  int64_t nonzero_pads = 0;
  for (int64_t r = 0; r < patches * heads; ++r)
    for (int64_t d = 0; d < padded; ++d) {
      const float value = y.as<float>()[r * padded + d];
      if (d < head_dim) {
        y_rows.as<float>()[r * head_dim + d] = value;
      } else if (value != 0.0f) {
        ++nonzero_pads;
      }
    }
  EXPECT_EQ(nonzero_pads, 0) << "pad columns not written as zeros";
  CompareResult rq = compare_tensors("q in padded heads, first 72 columns (bf16)", y_rows, q_ref);
  EXPECT_TRUE(rq.all_finite);
  EXPECT_LE(rq.rel_l2, 1e-2);
  expect_close("dx from padded heads (bf16)", dx_d, dx_ref, 1e-2);
}

TEST(VisionRopeGpu, BadArgumentsAreRejected) {
  DeviceTensor t = device_tensor(DType::bf16, {4, 72});
  DeviceTensor f = device_tensor(DType::f32, {4, 36});
  // head_dim not a multiple of 4
  EXPECT_THROW(vision_rope_forward_cuda(bf16_ptr(t), 70, bf16_ptr(t), 70, f32_ptr(f), f32_ptr(f), 4, 1, 70, nullptr),
               Error);
  // stride shorter than the heads
  EXPECT_THROW(vision_rope_forward_cuda(bf16_ptr(t), 72, bf16_ptr(t), 72, f32_ptr(f), f32_ptr(f), 4, 2, 72, nullptr),
               Error);
  // in place with different strides
  EXPECT_THROW(vision_rope_backward_cuda(bf16_ptr(t), 144, bf16_ptr(t), 72, f32_ptr(f), f32_ptr(f), 2, 1, 72, nullptr),
               Error);
  EXPECT_THROW(vision_rope_tables_cuda(nullptr, 4, 72, -1.0, f32_ptr(f), f32_ptr(f), nullptr), Error);
}

TEST(VisionRopeGpu, TimingAtVisionShapes) {
  std::vector<int64_t> grid_thw;
  for (int i = 0; i < 8; ++i) grid_thw.insert(grid_thw.end(), {1, 28, 28});  // 8 images of 448x448, patch 16
  HostTensor positions = positions_for(grid_thw);
  const int64_t patches = positions.shape()[0], heads = 16, head_dim = 72, stride = 3 * heads * head_dim;
  DeviceTensor positions_d = to_device(positions);
  DeviceTensor cos_d = device_tensor(DType::f32, {patches, head_dim / 2});
  DeviceTensor sin_d = device_tensor(DType::f32, {patches, head_dim / 2});
  DeviceTensor qkv = tiled_random_device_tensor({patches, stride}, 1, 1.0f);
  double tables = median_ms([&](cudaStream_t s) {
    vision_rope_tables_cuda(positions_d.view.as<int64_t>(), patches, head_dim, kTheta, f32_ptr(cos_d), f32_ptr(sin_d),
                            s);
  }, nullptr);
  print_bandwidth_timing("vision_rope tables 6272x36", tables, static_cast<double>(patches) * head_dim * 4);
  // q and k read and written (2 of the 3 thirds of qkv), tables read.
  const double bytes = 2.0 * patches * 2 * heads * head_dim * 2 + static_cast<double>(patches) * head_dim * 4;
  double fwd = median_ms([&](cudaStream_t s) {
    vision_rope_forward_cuda(bf16_ptr(qkv), stride, bf16_ptr(qkv), stride, f32_ptr(cos_d), f32_ptr(sin_d), patches,
                             2 * heads, head_dim, s);
  }, nullptr);
  print_bandwidth_timing("vision_rope q+k 6272x16x72 fwd in qkv", fwd, bytes);
  double bwd = median_ms([&](cudaStream_t s) {
    vision_rope_backward_cuda(bf16_ptr(qkv), stride, bf16_ptr(qkv), stride, f32_ptr(cos_d), f32_ptr(sin_d), patches,
                              2 * heads, head_dim, s);
  }, nullptr);
  print_bandwidth_timing("vision_rope q+k 6272x16x72 bwd in dqkv", bwd, bytes);
}

}  // namespace
}  // namespace deltamoe
