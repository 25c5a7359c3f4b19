// Gated DeltaNet gates: beta = sigmoid(b) and the log-space decay
// g = -exp(A_log) * softplus(a + dt_bias) (g <= 0). CPU reference, computed in fp32.
#pragma once

#include <cstdint>

namespace deltamoe {

// Shape legend: T tokens, H value heads (Hv).
//   a, b     [T, H]   outputs of in_proj_a and in_proj_b
//   A_log    [H]      parameter (decay rate in log space)
//   dt_bias  [H]      parameter
//   g, beta  [T, H]   outputs
// softplus is torch.nn.functional.softplus with beta 1 and threshold 20:
// softplus(x) = x for x > 20, else log(1 + exp(x)).

// Writes g and beta.
template <typename S>
void gdn_gates_forward_ref(const S* a, const S* b, const S* A_log, const S* dt_bias,
                           int64_t num_tokens, int num_heads, S* g, S* beta);

// Given dg and dbeta [T, H]: writes da and db [T, H]; ADDS to dA_log and ddt_bias [H] (each may be
// null: not computed, e.g. frozen parameters).
template <typename S>
void gdn_gates_backward_ref(const S* a, const S* b, const S* A_log, const S* dt_bias, const S* dg,
                            const S* dbeta, int64_t num_tokens, int num_heads, S* da, S* db,
                            S* dA_log, S* ddt_bias);

}  // namespace deltamoe
