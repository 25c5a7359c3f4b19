// Non-causal softmax attention confined to packed segments (the vision tower: one segment per
// image frame, every patch sees every patch of its own frame). Same number of q and kv heads.
// Legend: T tokens, H heads, D head dim, S segments given by cu_seqlens (int32, S+1 entries).
#pragma once

#include <cstdint>

namespace deltamoe {

// q, k, v [T, H, D]; out [T, H, D] written; lse [T, H] written: log sum_j exp(scale * q.k_j)
// over the token's segment (kept for the backward).
template <typename T>
void bidirectional_attention_forward_ref(const T* q, const T* k, const T* v, const int32_t* cu_seqlens,
                                         int64_t num_segments, T* out, T* lse, int64_t num_tokens, int64_t num_heads,
                                         int64_t head_dim, double scale);

// d_out [T, H, D] -> dq, dk, dv [T, H, D] written. out and lse come from the forward.
template <typename T>
void bidirectional_attention_backward_ref(const T* q, const T* k, const T* v, const T* out, const T* lse,
                                          const T* d_out, const int32_t* cu_seqlens, int64_t num_segments, T* dq,
                                          T* dk, T* dv, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                                          double scale);

}  // namespace deltamoe
