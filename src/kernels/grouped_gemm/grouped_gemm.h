// Grouped matrix products of the MoE experts, one weight matrix per group of consecutive rows:
// the row-grouped product (expert forward and input gradients) and the row-reduced product
// (expert weight gradients). Legend: R rows (all groups), G groups, M/N/K matrix sizes.
#pragma once

#include <cstdint>

namespace deltamoe {

// Rows [offsets[g], offsets[g+1]) of a [R, K] use weight b + g * N * K:
//   b_stored_nk true:  b_g stored [N, K], c[r] = a[r] b_g^T   (y = x W^T)
//   b_stored_nk false: b_g stored [K, N], c[r] = a[r] b_g     (dx = dy W)
// c [R, N] written. offsets int32 [G+1], non-decreasing, offsets[0] = 0, offsets[G] = R.
template <typename T>
void grouped_gemm_rows_ref(const T* a, const T* b, bool b_stored_nk, T* c, const int32_t* offsets, int64_t num_groups,
                           int64_t n, int64_t k);

// For each group g with rows [offsets[g], offsets[g+1]) of a [R, M] and b [R, N]:
//   c_g [M, N] += a_g^T b_g   (dW = dY^T X), c [G, M, N] added to.
template <typename T>
void grouped_gemm_weight_grad_ref(const T* a, const T* b, T* c, const int32_t* offsets, int64_t num_groups, int64_t m,
                                  int64_t n);

}  // namespace deltamoe
