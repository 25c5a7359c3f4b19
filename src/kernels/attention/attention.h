// Causal grouped-query attention over packed sequences (softmax(q k^T * scale) v per sequence), and
// the sigmoid output gate of Qwen3.5's gated attention (o * sigmoid(gate)).
// Legend: T tokens (all sequences back to back), Hq query heads, Hkv key/value heads, D head dim,
// N sequences. KV head j serves query heads [j * Hq / Hkv, (j + 1) * Hq / Hkv).
#pragma once

#include <cstdint>

namespace deltamoe {

struct AttentionDims {
  int64_t num_tokens = 0;    // T
  int64_t num_q_heads = 0;   // Hq
  int64_t num_kv_heads = 0;  // Hkv, divides Hq
  int64_t head_dim = 0;      // D
};

// q [T, Hq, D], k and v [T, Hkv, D]; cu_seqlens int32 [N + 1] (0, ..., T); scale usually D^-0.5.
// out [T, Hq, D] written; lse [T, Hq] written (log-sum-exp of each score row, for the backward).
template <typename T>
void attention_forward_ref(const AttentionDims& dims, const T* q, const T* k, const T* v, const int32_t* cu_seqlens,
                           int64_t num_seqs, double scale, T* out, T* lse);

// d_out [T, Hq, D] -> dq [T, Hq, D], dk and dv [T, Hkv, D], all written. out and lse from the forward.
template <typename T>
void attention_backward_ref(const AttentionDims& dims, const T* q, const T* k, const T* v, const T* out, const T* lse,
                            const T* d_out, const int32_t* cu_seqlens, int64_t num_seqs, double scale, T* dq, T* dk,
                            T* dv);

// Output gate: y = attn * sigmoid(gate), element-wise over count values; y written.
template <typename T>
void attention_gate_forward_ref(const T* attn, const T* gate, T* y, int64_t count);

// dy -> d_attn and d_gate, both written.
template <typename T>
void attention_gate_backward_ref(const T* attn, const T* gate, const T* dy, T* d_attn, T* d_gate, int64_t count);

// Throws unless cu_seqlens is 0 = c[0] <= c[1] <= ... <= c[N] = num_tokens.
void check_cu_seqlens(const int32_t* cu_seqlens, int64_t num_seqs, int64_t num_tokens, const char* where);

}  // namespace deltamoe
