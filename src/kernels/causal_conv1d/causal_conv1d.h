// Causal depthwise conv1d over time followed by SiLU (the short conv of Gated DeltaNet), over
// packed variable-length sequences. CPU reference (fp32; double for gradient checks).
#pragma once

#include <cstdint>

namespace deltamoe {

// Shape legend: T tokens (all sequences packed), C channels (conv_dim), K kernel width (4),
// N sequences.
//   x          [T, C]   channels last (the in_proj_qkv output as laid out in memory)
//   weight     [C, K]   HF stores [C, 1, K]; weight[c, K-1] multiplies the current token,
//                       weight[c, K-1-j] the token j steps back
//   cu_seqlens [N+1]    int32 packed-sequence offsets (first 0, last T)
//   y          [T, C]   y[t,c] = silu(sum_j weight[c,K-1-j] * x[t-j,c]), where taps that reach
//                       before the start of t's own sequence read zero (no token sees a previous
//                       sequence).
// No bias (Qwen3.5 has none).
// NOTE: HF's torch fallback runs the conv and SiLU in bf16; this reference is fp32 throughout.

// Writes y.
template <typename S>
void causal_conv1d_forward_ref(const S* x, const S* weight, const int32_t* cu_seqlens, int num_seqs,
                               int64_t num_tokens, int num_channels, int kernel_size, S* y);

// Given dy [T, C], writes dx [T, C] and ADDS the weight gradient to dweight [C, K] (null: not
// computed, e.g. a frozen weight).
// The pre-activation is recomputed from x.
template <typename S>
void causal_conv1d_backward_ref(const S* x, const S* weight, const S* dy, const int32_t* cu_seqlens,
                                int num_seqs, int64_t num_tokens, int num_channels, int kernel_size,
                                S* dx, S* dweight);

}  // namespace deltamoe
