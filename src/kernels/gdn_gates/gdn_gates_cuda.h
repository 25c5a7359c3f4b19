// CUDA launchers of the Gated DeltaNet gates (spec: gdn_gates.h): beta = sigmoid(b),
// g = -exp(A_log) * softplus(a + dt_bias). a, b bf16; parameters, g, beta and their grads fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe {

// a, b [T, H] bf16; A_log, dt_bias [H] fp32; writes g, beta [T, H] fp32 (the gated delta rule
// kernels take the fp32 gates and form the per-chunk cumulative sum of g themselves).
void gdn_gates_forward_cuda(const __nv_bfloat16* a, const __nv_bfloat16* b, const float* A_log,
                            const float* dt_bias, int64_t num_tokens, int num_heads, float* g,
                            float* beta, cudaStream_t stream);

// Given dg, dbeta [T, H] fp32: writes da, db [T, H] bf16; ADDS to dA_log, ddt_bias [H] fp32.
void gdn_gates_backward_cuda(const __nv_bfloat16* a, const __nv_bfloat16* b, const float* A_log,
                             const float* dt_bias, const float* dg, const float* dbeta,
                             int64_t num_tokens, int num_heads, __nv_bfloat16* da,
                             __nv_bfloat16* db, float* dA_log, float* ddt_bias,
                             cudaStream_t stream);

}  // namespace deltamoe
