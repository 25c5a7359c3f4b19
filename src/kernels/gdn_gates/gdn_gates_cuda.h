// CUDA launchers of the Gated DeltaNet gates (spec: gdn_gates.h): beta = sigmoid(b),
// g = -exp(A_log) * softplus(a + dt_bias). Everything fp32: a, b are [T, H] per-token gates whose
// weight gradients are sums over tokens that cancel, so one bf16 rounding per token shows up there.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe {

// a, b [T, H] fp32; A_log, dt_bias [H] fp32; writes g, beta [T, H] fp32 (the gated delta rule
// kernels take the fp32 gates and form the per-chunk cumulative sum of g themselves).
void gdn_gates_forward_cuda(const float* a, const float* b, const float* A_log,
                            const float* dt_bias, int64_t num_tokens, int num_heads, float* g,
                            float* beta, cudaStream_t stream);

// Given dg, dbeta [T, H] fp32: writes da, db [T, H] fp32; ADDS to dA_log, ddt_bias [H] fp32 (either
// may be null: frozen), summed in a fixed order (deterministic).
void gdn_gates_backward_cuda(const float* a, const float* b, const float* A_log,
                             const float* dt_bias, const float* dg, const float* dbeta,
                             int64_t num_tokens, int num_heads, float* da, float* db,
                             float* dA_log, float* ddt_bias,
                             cudaStream_t stream);

}  // namespace deltamoe
