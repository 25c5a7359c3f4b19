// GPU test that the dense products round once: every element of a bf16 product within half a bf16
// step (plus fp32 accumulation slack) of the exact result, with and without the bias epilogue. A
// rounded product plus a rounded bias add can be a whole step off; so can split-K parts added in
// bf16 (which GemmContext excludes). Shapes where cuBLASLt's heuristic tends to split K.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/gemm/gemm_cuda.h"
#include "kernels/gemm/gpu_test_util.h"

namespace deltamoe {
namespace {

// |got - exact| / (half a bf16 step of exact + accumulation slack), worst element; <= 1 when the
// fp32 accumulator was rounded once. The slack, 2^-21 of the sum of |terms|, covers the fp32
// accumulation in any order (and tensor-core alignment) and is far below a bf16 step for K <= 256.
double worst_in_half_steps(const HostTensor& got_device_copy, const std::vector<double>& exact,
                           const std::vector<double>& abs_terms) {
  const HostTensor got = got_device_copy.to_f32();
  double worst = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    const double r = exact[i];
    if (r == 0) continue;
    const double half_step = std::ldexp(1.0, static_cast<int>(std::floor(std::log2(std::abs(r)))) - 8);
    worst = std::max(worst, std::abs(got.as<float>()[i] - r) / (half_step + std::ldexp(abs_terms[i], -21)));
  }
  return worst;
}

void check_rounds_once(int64_t rows, int64_t in_features, int64_t out_features, uint64_t seed) {
  std::printf("rounding rows=%lld in=%lld out=%lld\n", static_cast<long long>(rows),
              static_cast<long long>(in_features), static_cast<long long>(out_features));
  HostTensor x = random_bf16_exact({rows, in_features}, seed);
  HostTensor w = random_bf16_exact({out_features, in_features}, seed + 1, 0.1f);
  HostTensor bias = random_bf16_exact({out_features}, seed + 2, 2.0f);
  const size_t count = static_cast<size_t>(rows * out_features);
  std::vector<double> product(count), with_bias(count), abs_terms(count), abs_terms_bias(count);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < out_features; ++n) {
      double acc = 0, abs_sum = 0;
      for (int64_t k = 0; k < in_features; ++k) {
        const double term = static_cast<double>(x.as<float>()[r * in_features + k]) * w.as<float>()[n * in_features + k];
        acc += term;
        abs_sum += std::abs(term);
      }
      const size_t i = static_cast<size_t>(r * out_features + n);
      product[i] = acc;
      with_bias[i] = acc + bias.as<float>()[n];
      abs_terms[i] = abs_sum;
      abs_terms_bias[i] = abs_sum + std::abs(bias.as<float>()[n]);
    }
  DeviceTensor x_d = to_device(x, DType::bf16), w_d = to_device(w, DType::bf16), b_d = to_device(bias, DType::bf16);
  DeviceTensor y_d = poisoned_device_tensor(DType::bf16, {rows, out_features});
  DeviceTensor p_d = poisoned_device_tensor(DType::bf16, {rows, out_features});
  GemmContext gemm;
  linear_forward_bias_cuda(gemm, bf16_ptr(x_d), bf16_ptr(w_d), bf16_ptr(b_d), bf16_ptr(y_d), rows, in_features,
                           out_features, nullptr);
  linear_forward_cuda(gemm, bf16_ptr(x_d), bf16_ptr(w_d), bf16_ptr(p_d), DType::bf16, rows, in_features,
                      out_features, nullptr);
  device_synchronize();
  const double with_bias_worst = worst_in_half_steps(to_host(y_d.view), with_bias, abs_terms_bias);
  const double product_worst = worst_in_half_steps(to_host(p_d.view), product, abs_terms);
  std::printf("  worst error in half bf16 steps: with bias %.3f, product alone %.3f (one rounding: <= 1)\n",
              with_bias_worst, product_worst);
  EXPECT_LE(with_bias_worst, 1.0);
  EXPECT_LE(product_worst, 1.0);
}

TEST(GemmRoundingGpu, ProductsWithAndWithoutBiasRoundOnce) {
  check_rounds_once(1, 72, 216, 80);     // one row
  check_rounds_once(37, 64, 24, 81);     // odd rows, narrow output
  check_rounds_once(300, 128, 130, 82);  // odd output width
  check_rounds_once(64, 256, 96, 83);    // longer K, few rows and columns
}

TEST(GemmRoundingGpu, NullBiasIsRejected) {
  DeviceTensor t = device_tensor(DType::bf16, {4, 8});
  GemmContext gemm;
  EXPECT_THROW(linear_forward_bias_cuda(gemm, bf16_ptr(t), bf16_ptr(t), nullptr, bf16_ptr(t), 4, 8, 4, nullptr),
               Error);
}

}  // namespace
}  // namespace deltamoe
