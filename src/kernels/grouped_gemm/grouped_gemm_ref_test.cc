// CPU test of the grouped-product reference against the linear reference applied group by group
// (an independent formulation), with empty groups, and its offset checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "core/error.h"
#include "kernels/common/tensor_compare.h"
#include "kernels/grouped_gemm/grouped_gemm.h"
#include "kernels/linear/linear.h"

namespace deltamoe {
namespace {

TEST(GroupedGemmRef, MatchesLinearPerGroup) {
  const int64_t groups = 4, n = 7, k = 5, m = 6;
  const std::vector<int32_t> offsets = {0, 3, 3, 11, 12};  // group 1 empty
  const int64_t rows = offsets.back();
  HostTensor a = random_normal_tensor({rows, k}, 1), w = random_normal_tensor({groups, n, k}, 2);
  HostTensor c(DType::f32, {rows, n}), c_linear(DType::f32, {rows, n});
  grouped_gemm_rows_ref(a.as<float>(), w.as<float>(), true, c.as<float>(), offsets.data(), groups, n, k);
  // Same weights stored [K, N]: transpose each group.
  HostTensor w_kn(DType::f32, {groups, k, n});
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < k; ++j) w_kn.as<float>()[(g * k + j) * n + i] = w.as<float>()[(g * n + i) * k + j];
  HostTensor c_kn(DType::f32, {rows, n});
  grouped_gemm_rows_ref(a.as<float>(), w_kn.as<float>(), false, c_kn.as<float>(), offsets.data(), groups, n, k);

  HostTensor b = random_normal_tensor({rows, m}, 3), dw = random_normal_tensor({groups, m, k}, 4);
  HostTensor dw_linear = random_normal_tensor({groups, m, k}, 4);
  grouped_gemm_weight_grad_ref(b.as<float>(), a.as<float>(), dw.as<float>(), offsets.data(), groups, m, k);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = offsets[g], count = offsets[g + 1] - offsets[g];
    if (count == 0) continue;
    linear_forward_ref(a.as<float>() + r0 * k, w.as<float>() + g * n * k, c_linear.as<float>() + r0 * n, count, k, n);
    // d_weight += dy^T x with dy = b rows [count, m], x = a rows [count, k]; the weight argument
    // is not read when dx is null.
    linear_backward_ref<float>(a.as<float>() + r0 * k, dw_linear.as<float>() + g * m * k, b.as<float>() + r0 * m,
                               nullptr, dw_linear.as<float>() + g * m * k, count, k, m);
  }
  CompareResult r1 = compare_tensors("rows [N,K] vs linear", c, c_linear);
  CompareResult r2 = compare_tensors("rows [K,N] vs linear", c_kn, c_linear);
  CompareResult r3 = compare_tensors("weight grad vs linear", dw, dw_linear);
  EXPECT_LE(r1.rel_l2, 1e-6);
  EXPECT_LE(r2.rel_l2, 1e-6);
  EXPECT_LE(r3.rel_l2, 1e-6);
}

TEST(GroupedGemmRef, BadOffsetsAreRefused) {
  float a[4] = {1, 2, 3, 4}, w[4] = {1, 1, 1, 1}, c[4];
  const int32_t decreasing[] = {0, 2, 1};
  const int32_t not_from_zero[] = {1, 2, 2};
  EXPECT_THROW(grouped_gemm_rows_ref(a, w, true, c, decreasing, 2, 1, 2), Error);
  EXPECT_THROW(grouped_gemm_rows_ref(a, w, true, c, not_from_zero, 2, 1, 2), Error);
  EXPECT_THROW(grouped_gemm_weight_grad_ref(a, a, c, decreasing, 2, 1, 1), Error);
}

}  // namespace
}  // namespace deltamoe
