// GPU test of the hi/lo bf16 split products (f32_operand_cuda.h) against an fp64 CPU reference on
// unrounded fp32 gradients, with a bf16-rounded control that must be far worse; timed at the 35B
// gate widths (GDN a/b: 32 heads; router: 256 experts) for 8192 tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "core/device_buffer.h"
#include "core/error.h"
#include "kernels/common/tensor_compare.h"
#include "kernels/gemm/f32_operand_cuda.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/linear/linear.h"

namespace deltamoe {
namespace {

// The split leaves ~2^-17 relative per element and cuBLAS accumulates in fp32 in its own order:
// rel_l2 well under 1e-5 is expected; 2e-5 leaves room for fp32 summation over 8192 rows.
constexpr double kSplitTolerance = 2e-5;
// One bf16 rounding of the fp32 operand is ~2^-9 relative (rel_l2 ~1e-3): the split must beat it
// by far, or the split is not doing its job.
constexpr double kControlMargin = 20.0;

struct SplitShape {
  int64_t rows, in_features, out_features;
};

HostTensor to_f32_tensor(const std::vector<double>& values, Shape shape) {
  HostTensor out(DType::f32, shape);
  for (size_t i = 0; i < values.size(); ++i) out.as<float>()[i] = static_cast<float>(values[i]);
  return out;
}

std::vector<double> to_f64(const HostTensor& t) {
  const float* p = t.as<float>();
  return std::vector<double>(p, p + t.shape().numel());
}

void check_split(GemmContext& ctx, const SplitShape& s, uint64_t seed) {
  const int64_t T = s.rows, K = s.in_features, N = s.out_features;
  std::printf("split products T=%lld K=%lld N=%lld\n", static_cast<long long>(T), static_cast<long long>(K),
              static_cast<long long>(N));
  // dy is the fp32 gate gradient (never rounded); x and W are bf16 as in the model.
  const HostTensor dy = random_normal_tensor({T, N}, seed);
  const HostTensor x = random_bf16_exact({T, K}, seed + 1);
  const HostTensor w = random_bf16_exact({N, K}, seed + 2, 1.0f / std::sqrt(static_cast<float>(N)));
  const HostTensor dx_init = random_normal_tensor({T, K}, seed + 3, 0.5f);
  const HostTensor dw_init = random_normal_tensor({N, K}, seed + 4, 0.5f);

  // fp64 reference: dx = dx_init + dy W, dw = dw_init + dy^T x.
  std::vector<double> dx_ref(static_cast<size_t>(T * K)), dw_ref = to_f64(dw_init);
  const std::vector<double> dy64 = to_f64(dy), x64 = to_f64(x), w64 = to_f64(w);
  linear_backward_ref(x64.data(), w64.data(), dy64.data(), dx_ref.data(), dw_ref.data(), T, K, N);
  for (int64_t i = 0; i < T * K; ++i) dx_ref[static_cast<size_t>(i)] += dx_init.as<float>()[i];

  DeviceTensor dy_d = to_device(dy), x_d = to_device(x, DType::bf16), w_d = to_device(w, DType::bf16);
  DeviceTensor hi = poisoned_device_tensor(DType::bf16, {T, N}), lo = poisoned_device_tensor(DType::bf16, {T, N});
  DeviceTensor dx_d = to_device(dx_init), dw_d = to_device(dw_init);
  DeviceTensor dw_control = to_device(dw_init);
  split_f32_to_bf16_hi_lo_cuda(f32_ptr(dy_d), bf16_ptr(hi), bf16_ptr(lo), T * N, nullptr);
  linear_backward_input_split_cuda(ctx, bf16_ptr(hi), bf16_ptr(lo), bf16_ptr(w_d), f32_ptr(dx_d), true, T, K, N,
                                   nullptr);
  linear_backward_weight_split_cuda(ctx, bf16_ptr(hi), bf16_ptr(lo), bf16_ptr(x_d), f32_ptr(dw_d), T, K, N, nullptr);
  // Control: what the model did before, the gradient rounded to bf16 once (hi alone).
  linear_backward_weight_cuda(ctx, bf16_ptr(hi), bf16_ptr(x_d), f32_ptr(dw_control), T, K, N, nullptr);
  device_synchronize();

  // hi + lo must rebuild dy to ~2^-17 relative per element.
  const HostTensor hi_h = to_host(hi.view).to_f32(), lo_h = to_host(lo.view).to_f32();
  HostTensor rebuilt(DType::f32, {T, N});
  for (int64_t i = 0; i < T * N; ++i) rebuilt.as<float>()[i] = hi_h.as<float>()[i] + lo_h.as<float>()[i];
  const CompareResult r_split = compare_tensors("hi + lo vs dy", rebuilt, dy);
  const CompareResult r_hi = compare_tensors("hi alone vs dy (control)", hi_h, dy);
  const HostTensor dx_ref_t = to_f32_tensor(dx_ref, {T, K}), dw_ref_t = to_f32_tensor(dw_ref, {N, K});
  const CompareResult r_dx = compare_tensors("dx += dy W (split, f32)", to_host(dx_d.view), dx_ref_t);
  const CompareResult r_dw = compare_tensors("dW += dy^T x (split, f32)", to_host(dw_d.view), dw_ref_t);
  const CompareResult r_dw_control = compare_tensors("dW += bf16(dy)^T x (control)", to_host(dw_control.view), dw_ref_t);
  EXPECT_TRUE(r_split.all_finite && r_dx.all_finite && r_dw.all_finite);
  EXPECT_LE(r_split.rel_l2, 1e-5);
  EXPECT_LE(r_dx.rel_l2, kSplitTolerance);
  EXPECT_LE(r_dw.rel_l2, kSplitTolerance);
  EXPECT_GT(r_hi.rel_l2, kControlMargin * r_split.rel_l2) << "the lo half adds nothing";
  EXPECT_GT(r_dw_control.rel_l2, kControlMargin * r_dw.rel_l2) << "the split is no better than one bf16 rounding";
}

TEST(F32OperandGpu, SplitProductsMatchFp64Reference) {
  GemmContext ctx;
  const SplitShape shapes[] = {
      {1, 64, 32},      // T = 1
      {37, 53, 5},      // odd everything
      {300, 130, 33},   // odd gate count
      {8192, 2048, 32}, // 35B GDN in_proj_a / in_proj_b (32 value heads)
      {513, 2048, 256}, // 35B router (256 experts), odd token count
  };
  uint64_t seed = 500;
  for (const SplitShape& shape : shapes) check_split(ctx, shape, seed += 10);
}

TEST(F32OperandGpu, AddBf16ToF32IsExactFp32Add) {
  for (const int64_t count : {int64_t{1}, int64_t{1000003}}) {
    const HostTensor src = random_bf16_exact({count}, 61);
    const HostTensor dst = random_normal_tensor({count}, 62, 0.3f);
    HostTensor ref(DType::f32, {count});
    for (int64_t i = 0; i < count; ++i) ref.as<float>()[i] = dst.as<float>()[i] + src.as<float>()[i];
    DeviceTensor src_d = to_device(src, DType::bf16), dst_d = to_device(dst);
    add_bf16_to_f32_cuda(bf16_ptr(src_d), f32_ptr(dst_d), count, nullptr);
    device_synchronize();
    // One fp32 add of the widened bf16 value on both sides: bit-exact.
    const CompareResult r = compare_tensors("dst + f32(src)", to_host(dst_d.view), ref);
    EXPECT_TRUE(r.all_finite);
    EXPECT_EQ(r.max_abs_diff, 0.0);
  }
}

TEST(F32OperandGpu, NegativeCountIsRejected) {
  EXPECT_THROW(split_f32_to_bf16_hi_lo_cuda(nullptr, nullptr, nullptr, -1, nullptr), Error);
  EXPECT_THROW(add_bf16_to_f32_cuda(nullptr, nullptr, -1, nullptr), Error);
}

// The cost of the split against the one-GEMM bf16 path it replaces, at 8192 tokens.
TEST(F32OperandGpu, TimingAt35BShapes) {
  GemmContext ctx;
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  const int64_t T = 8192, C = 2048;
  for (const int64_t n : {int64_t{32}, int64_t{256}}) {
    std::printf("gate width %lld (32: GDN a/b per layer, x2; 256: router)\n", static_cast<long long>(n));
    DeviceTensor dy = to_device(random_normal_tensor({T, n}, 1));
    DeviceTensor x = tiled_random_device_tensor({T, C}, 2, 1.0f);
    DeviceTensor w = to_device(random_normal_tensor({n, C}, 3, 0.02f), DType::bf16);
    DeviceTensor hi = device_tensor(DType::bf16, {T, n}), lo = device_tensor(DType::bf16, {T, n});
    DeviceTensor dx = device_tensor(DType::f32, {T, C});
    DeviceTensor dw = to_device(random_normal_tensor({n, C}, 4), DType::f32);
    const double flops = 2.0 * T * C * static_cast<double>(n);
    const double split_ms = median_ms([&](cudaStream_t s) {
      split_f32_to_bf16_hi_lo_cuda(f32_ptr(dy), bf16_ptr(hi), bf16_ptr(lo), T * n, s);
    }, stream);
    print_bandwidth_timing("split f32 -> bf16 hi, lo", split_ms, static_cast<double>(T * n) * (4 + 2 + 2));
    const double dx_split = median_ms([&](cudaStream_t s) {
      linear_backward_input_split_cuda(ctx, bf16_ptr(hi), bf16_ptr(lo), bf16_ptr(w), f32_ptr(dx), true, T, C, n, s);
    }, stream);
    print_flop_timing("dX += (hi + lo) W  (2 GEMMs)", dx_split, 2 * flops);
    const double dx_one = median_ms([&](cudaStream_t s) {
      gemm_bf16_cuda(ctx, false, false, T, C, n, 1.0f, bf16_ptr(hi), n, bf16_ptr(w), C, 1.0f, dx.view.data,
                     DType::f32, C, s);
    }, stream);
    print_flop_timing("dX += bf16(dy) W  (1 GEMM, before)", dx_one, flops);
    const double dw_split = median_ms([&](cudaStream_t s) {
      linear_backward_weight_split_cuda(ctx, bf16_ptr(hi), bf16_ptr(lo), bf16_ptr(x), f32_ptr(dw), T, C, n, s);
    }, stream);
    print_flop_timing("dW += (hi + lo)^T x  (2 GEMMs)", dw_split, 2 * flops);
    const double dw_one = median_ms([&](cudaStream_t s) {
      linear_backward_weight_cuda(ctx, bf16_ptr(hi), bf16_ptr(x), f32_ptr(dw), T, C, n, s);
    }, stream);
    print_flop_timing("dW += bf16(dy)^T x  (1 GEMM, before)", dw_one, flops);
    std::printf("  split path extra per product pair: %.3f ms\n", split_ms + dx_split + dw_split - dx_one - dw_one);
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace deltamoe
