// GPU test of the stacked hi/lo products (f32_operand_cuda.h) against an fp64 CPU reference on
// unrounded fp32 gradients, with a bf16-rounded control that must be far worse: GDN's form (two
// fp32 gradients against bf16 weights, blocks [hi | lo] each) and the router's (an fp32 weight as a
// hi/lo pair too, blocks [hi | hi | lo] against [w_hi; w_lo; w_hi]); the packing and the pair add
// bit for bit; timed at the 35B gate widths (GDN a/b: 2 x 32 heads; router: 256 experts) at 8192
// tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "core/cuda_check.h"
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

struct GateShape {
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

void copy_rows(const DeviceTensor& src, __nv_bfloat16* dst, int64_t elements) {
  CUDA_CHECK(cudaMemcpy(dst, src.view.data, static_cast<size_t>(elements) * 2, cudaMemcpyDeviceToDevice));
}

// GDN's form: dx += dy_a Wa + dy_b Wb and dW_g += dy_g^T x, dy_a and dy_b fp32, through the blocks
// [a_hi | a_lo | b_hi | b_lo] and [Wa; Wa; Wb; Wb], one dX product and one dW product.
void check_two_gates(GemmContext& ctx, const GateShape& s, uint64_t seed) {
  const int64_t T = s.rows, K = s.in_features, N = s.out_features;
  std::printf("two fp32 gates T=%lld K=%lld N=%lld\n", static_cast<long long>(T), static_cast<long long>(K),
              static_cast<long long>(N));
  const HostTensor dy[2] = {random_normal_tensor({T, N}, seed), random_normal_tensor({T, N}, seed + 1)};
  const HostTensor w[2] = {random_bf16_exact({N, K}, seed + 2, 1.0f / std::sqrt(static_cast<float>(N))),
                           random_bf16_exact({N, K}, seed + 3, 1.0f / std::sqrt(static_cast<float>(N)))};
  const HostTensor x = random_bf16_exact({T, K}, seed + 4);
  const HostTensor dx_init = random_normal_tensor({T, K}, seed + 5, 0.5f);
  const HostTensor dw_init = random_normal_tensor({N, K}, seed + 6, 0.5f);

  // fp64 reference: dx = dx_init + sum_g dy_g W_g, dW_g = dw_init + dy_g^T x.
  std::vector<double> dx_ref = to_f64(dx_init);
  std::vector<double> dw_ref[2] = {to_f64(dw_init), to_f64(dw_init)};
  const std::vector<double> x64 = to_f64(x);
  for (int g = 0; g < 2; ++g) {
    std::vector<double> dx_part(static_cast<size_t>(T * K));
    const std::vector<double> dy64 = to_f64(dy[g]), w64 = to_f64(w[g]);
    linear_backward_ref(x64.data(), w64.data(), dy64.data(), dx_part.data(), dw_ref[g].data(), T, K, N);
    for (size_t i = 0; i < dx_ref.size(); ++i) dx_ref[i] += dx_part[i];
  }

  DeviceTensor dy_d[2] = {to_device(dy[0]), to_device(dy[1])};
  DeviceTensor w_d[2] = {to_device(w[0], DType::bf16), to_device(w[1], DType::bf16)};
  DeviceTensor x_d = to_device(x, DType::bf16);
  DeviceTensor packed = poisoned_device_tensor(DType::bf16, {T, 4 * N});
  DeviceTensor stack = poisoned_device_tensor(DType::bf16, {4 * N, K});
  DeviceTensor parts = poisoned_device_tensor(DType::f32, {4 * N, K});
  DeviceTensor dx_d = to_device(dx_init);
  DeviceTensor dw_control = to_device(dw_init);
  for (int g = 0; g < 2; ++g) {
    pack_f32_hi_lo_cuda(f32_ptr(dy_d[g]), T, N, bf16_ptr(packed), 4 * N, 2 * g * N, (2 * g + 1) * N, -1, nullptr);
    copy_rows(w_d[g], bf16_ptr(stack) + 2 * g * N * K, N * K);
    copy_rows(w_d[g], bf16_ptr(stack) + (2 * g + 1) * N * K, N * K);
  }
  linear_backward_input_f32_cuda(ctx, bf16_ptr(packed), bf16_ptr(stack), f32_ptr(dx_d), true, T, K, 4 * N, nullptr);
  gemm_bf16_cuda(ctx, true, false, 4 * N, K, T, 1.0f, bf16_ptr(packed), 4 * N, bf16_ptr(x_d), K, 0.0f, parts.view.data,
                 DType::f32, K, nullptr);
  // Control: what the model did before the split, the gradient rounded to bf16 once (gate a's hi
  // block alone, read in place).
  gemm_bf16_cuda(ctx, true, false, N, K, T, 1.0f, bf16_ptr(packed), 4 * N, bf16_ptr(x_d), K, 1.0f,
                 dw_control.view.data, DType::f32, K, nullptr);
  device_synchronize();

  // Each gradient adds its hi and lo parts, as the model does (optim's add_f32_cuda, one fp32 add each).
  const HostTensor parts_h = to_host(parts.view);
  HostTensor dw_got[2] = {HostTensor(DType::f32, {N, K}), HostTensor(DType::f32, {N, K})};
  for (int g = 0; g < 2; ++g) {
    for (int64_t i = 0; i < N * K; ++i) {
      dw_got[g].as<float>()[i] = (dw_init.as<float>()[i] + parts_h.as<float>()[2 * g * N * K + i]) +
                                 parts_h.as<float>()[(2 * g + 1) * N * K + i];
    }
  }
  const HostTensor dx_ref_t = to_f32_tensor(dx_ref, {T, K});
  const CompareResult r_dx = compare_tensors("dx += dy_a Wa + dy_b Wb (stacked)", to_host(dx_d.view), dx_ref_t);
  EXPECT_TRUE(r_dx.all_finite);
  EXPECT_LE(r_dx.rel_l2, kSplitTolerance);
  for (int g = 0; g < 2; ++g) {
    const CompareResult r_dw = compare_tensors(g == 0 ? "dWa += dy_a^T x" : "dWb += dy_b^T x", dw_got[g],
                                               to_f32_tensor(dw_ref[g], {N, K}));
    EXPECT_TRUE(r_dw.all_finite);
    EXPECT_LE(r_dw.rel_l2, kSplitTolerance);
    if (g == 0) {
      const CompareResult r_control = compare_tensors("dWa += bf16(dy_a)^T x (control)", to_host(dw_control.view),
                                                      to_f32_tensor(dw_ref[0], {N, K}));
      EXPECT_GT(r_control.rel_l2, kControlMargin * r_dw.rel_l2) << "the split is no better than one bf16 rounding";
    }
  }
}

TEST(F32OperandGpu, TwoGateProductsMatchFp64Reference) {
  GemmContext ctx;
  const GateShape shapes[] = {
      {1, 64, 32},      // T = 1
      {37, 53, 5},      // odd everything
      {300, 130, 33},   // odd gate count
      {8192, 2048, 32}, // 35B GDN in_proj_a / in_proj_b (32 value heads)
  };
  uint64_t seed = 500;
  for (const GateShape& shape : shapes) check_two_gates(ctx, shape, seed += 10);
}

// The router's form: dx = dy W with dy and W both fp32, W as its hi/lo pair; blocks [hi | hi | lo]
// against [w_hi; w_lo; w_hi] (the lo x lo term left out, ~2^-18 relative).
TEST(F32OperandGpu, RouterFormMatchesFp64Reference) {
  GemmContext ctx;
  for (const GateShape& s : {GateShape{513, 2048, 256}, GateShape{45, 70, 9}}) {
    const int64_t T = s.rows, K = s.in_features, E = s.out_features;
    const HostTensor dy = random_normal_tensor({T, E}, 71);
    const HostTensor w = random_normal_tensor({E, K}, 72, 0.02f);
    std::vector<double> dx_ref(static_cast<size_t>(T * K), 0.0), dw_unused(static_cast<size_t>(E * K), 0.0);
    const std::vector<double> dy64 = to_f64(dy), w64 = to_f64(w), x_unused(static_cast<size_t>(T * K), 0.0);
    linear_backward_ref(x_unused.data(), w64.data(), dy64.data(), dx_ref.data(), dw_unused.data(), T, K, E);

    DeviceTensor dy_d = to_device(dy), w_d = to_device(w);
    DeviceTensor packed = poisoned_device_tensor(DType::bf16, {T, 3 * E});
    DeviceTensor stack = poisoned_device_tensor(DType::bf16, {3 * E, K});
    DeviceTensor dx_d = poisoned_device_tensor(DType::f32, {T, K});
    split_f32_to_bf16_hi_lo_cuda(f32_ptr(w_d), bf16_ptr(stack), bf16_ptr(stack) + E * K, E * K, nullptr);
    CUDA_CHECK(cudaMemcpy(bf16_ptr(stack) + 2 * E * K, bf16_ptr(stack), static_cast<size_t>(E * K) * 2,
                          cudaMemcpyDeviceToDevice));
    pack_f32_hi_lo_cuda(f32_ptr(dy_d), T, E, bf16_ptr(packed), 3 * E, 0, 2 * E, E, nullptr);
    linear_backward_input_f32_cuda(ctx, bf16_ptr(packed), bf16_ptr(stack), f32_ptr(dx_d), false, T, K, 3 * E, nullptr);
    device_synchronize();
    const CompareResult r = compare_tensors("dx = dy W (router form)", to_host(dx_d.view), to_f32_tensor(dx_ref, {T, K}));
    EXPECT_TRUE(r.all_finite);
    EXPECT_LE(r.rel_l2, kSplitTolerance);
  }
}

// Every block holds exactly the plain split's values, and the columns outside the blocks are left
// as they were.
TEST(F32OperandGpu, PackWritesTheSplitIntoItsBlocks) {
  const int64_t rows = 77, cols = 13, ld = 3 * cols + 5;
  const HostTensor x = random_normal_tensor({rows, cols}, 81);
  DeviceTensor x_d = to_device(x);
  DeviceTensor hi = poisoned_device_tensor(DType::bf16, {rows, cols}), lo = poisoned_device_tensor(DType::bf16, {rows, cols});
  DeviceTensor packed = poisoned_device_tensor(DType::bf16, {rows, ld});
  const HostTensor before = to_host(packed.view);
  split_f32_to_bf16_hi_lo_cuda(f32_ptr(x_d), bf16_ptr(hi), bf16_ptr(lo), rows * cols, nullptr);
  const int64_t hi_col = 2 * cols + 5, lo_col = 0, hi2_col = cols + 2;
  pack_f32_hi_lo_cuda(f32_ptr(x_d), rows, cols, bf16_ptr(packed), ld, hi_col, lo_col, hi2_col, nullptr);
  device_synchronize();
  const HostTensor p = to_host(packed.view), h = to_host(hi.view), l = to_host(lo.view);
  const auto* pv = static_cast<const uint16_t*>(p.data());
  const auto* bv = static_cast<const uint16_t*>(before.data());
  const auto* hv = static_cast<const uint16_t*>(h.data());
  const auto* lv = static_cast<const uint16_t*>(l.data());
  int64_t wrong = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < ld; ++c) {
      uint16_t want = bv[r * ld + c];
      if (c >= hi_col && c < hi_col + cols) want = hv[r * cols + c - hi_col];
      if (c >= hi2_col && c < hi2_col + cols) want = hv[r * cols + c - hi2_col];
      if (c >= lo_col && c < lo_col + cols) want = lv[r * cols + c - lo_col];
      wrong += pv[r * ld + c] != want;
    }
  }
  EXPECT_EQ(wrong, 0);
}

TEST(F32OperandGpu, PairAddIsTwoFp32AddsInOrder) {
  for (const int64_t count : {int64_t{1}, int64_t{1000003}}) {
    const HostTensor a16 = random_bf16_exact({count}, 61), b16 = random_bf16_exact({count}, 62);
    const HostTensor dst = random_normal_tensor({count}, 65, 0.3f);
    HostTensor ref16(DType::f32, {count});
    for (int64_t i = 0; i < count; ++i)
      ref16.as<float>()[i] = (dst.as<float>()[i] + a16.as<float>()[i]) + b16.as<float>()[i];
    DeviceTensor a16_d = to_device(a16, DType::bf16), b16_d = to_device(b16, DType::bf16);
    DeviceTensor dst16 = to_device(dst);
    add_bf16_pair_to_f32_cuda(bf16_ptr(a16_d), bf16_ptr(b16_d), f32_ptr(dst16), count, nullptr);
    device_synchronize();
    // The same two fp32 adds on both sides: bit-exact.
    EXPECT_EQ(compare_tensors("(dst + a) + b, bf16 a, b", to_host(dst16.view), ref16).max_abs_diff, 0.0);
  }
}

TEST(F32OperandGpu, BadArgumentsAreRejected) {
  EXPECT_THROW(split_f32_to_bf16_hi_lo_cuda(nullptr, nullptr, nullptr, -1, nullptr), Error);
  EXPECT_THROW(add_bf16_pair_to_f32_cuda(nullptr, nullptr, nullptr, -1, nullptr), Error);
  // Overlapping blocks, a block past the row, and a hi2 block on top of lo.
  EXPECT_THROW(pack_f32_hi_lo_cuda(nullptr, 4, 8, nullptr, 16, 0, 4, -1, nullptr), Error);
  EXPECT_THROW(pack_f32_hi_lo_cuda(nullptr, 4, 8, nullptr, 16, 0, 9, -1, nullptr), Error);
  EXPECT_THROW(pack_f32_hi_lo_cuda(nullptr, 4, 8, nullptr, 24, 0, 8, 12, nullptr), Error);
}

// The stacked products at 8192 tokens: GDN's two gates (K = 4 x 32) and the router (K = 3 x 256),
// beside one bf16 product of the same gradient (what a bf16 model pays).
TEST(F32OperandGpu, TimingAt35BShapes) {
  GemmContext ctx;
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  const int64_t T = 8192, C = 2048;
  for (const int64_t blocks_width : {int64_t{4 * 32}, int64_t{3 * 256}}) {
    std::printf("stacked width %lld (128: GDN a/b; 768: router)\n", static_cast<long long>(blocks_width));
    const int64_t n = blocks_width == 128 ? 32 : 256;
    DeviceTensor dy = to_device(random_normal_tensor({T, n}, 1));
    DeviceTensor x = tiled_random_device_tensor({T, C}, 2, 1.0f);
    DeviceTensor stack = to_device(random_normal_tensor({blocks_width, C}, 3, 0.02f), DType::bf16);
    DeviceTensor packed = device_tensor(DType::bf16, {T, blocks_width});
    DeviceTensor dx = device_tensor(DType::f32, {T, C});
    DeviceTensor parts = device_tensor(DType::f32, {blocks_width, C});
    const double pack_ms = median_ms([&](cudaStream_t s) {
      pack_f32_hi_lo_cuda(f32_ptr(dy), T, n, bf16_ptr(packed), blocks_width, 0, n, -1, s);
    }, stream);
    print_bandwidth_timing("pack one fp32 gradient", pack_ms, static_cast<double>(T * n) * (4 + 2 + 2));
    const double dx_ms = median_ms([&](cudaStream_t s) {
      linear_backward_input_f32_cuda(ctx, bf16_ptr(packed), bf16_ptr(stack), f32_ptr(dx), true, T, C, blocks_width, s);
    }, stream);
    print_flop_timing("dX += blocks stack (1 GEMM)", dx_ms, 2.0 * T * C * static_cast<double>(blocks_width));
    const double dw_ms = median_ms([&](cudaStream_t s) {
      gemm_bf16_cuda(ctx, true, false, blocks_width, C, T, 1.0f, bf16_ptr(packed), blocks_width, bf16_ptr(x), C, 0.0f,
                     parts.view.data, DType::f32, C, s);
    }, stream);
    print_flop_timing("dW parts = blocks^T x (1 GEMM)", dw_ms, 2.0 * T * C * static_cast<double>(blocks_width));
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace deltamoe
