// The gated delta rule (core of Gated DeltaNet) over packed sequences with GQA, forward and
// backward: a token-by-token recurrent reference (the oracle) and a chunked WY/UT form (the
// algorithm the GPU kernels follow). CPU references, fp32 (double for gradient checks).
#pragma once

#include <cstdint>

namespace deltamoe {

constexpr int kGatedDeltaRuleChunkSize = 64;

// Shape legend: T tokens (packed), N sequences, Hk key/query heads, Hv value heads (a multiple of
// Hk), Dk key head dim, Dv value head dim.
struct GatedDeltaRuleShape {
  const int32_t* cu_seqlens = nullptr;  // [N+1] int32, first 0, last T
  int num_seqs = 0;                     // N
  int64_t num_tokens = 0;               // T
  int num_key_heads = 0;                // Hk
  int num_value_heads = 0;              // Hv; value head h uses key head h / (Hv / Hk)
  int key_dim = 0;                      // Dk
  int value_dim = 0;                    // Dv
};

// Tensors (all contiguous):
//   q, k           [T, Hk, Dk]  ALREADY l2-normalised by the caller (l2norm op); q is NOT
//                               pre-scaled: `scale` multiplies q inside (Qwen3.5: Dk^-0.5)
//   v              [T, Hv, Dv]
//   g              [T, Hv]      log-space decay (<= 0); the state decays by exp(g_t)
//   beta           [T, Hv]      delta-rule step size (sigmoid output)
//   initial_state  [N, Hv, Dk, Dv] or null (zeros)
//   o              [T, Hv, Dv]
//   final_state    [N, Hv, Dk, Dv] or null (not wanted)
// Per sequence and value head, with state S [Dk, Dv] starting at the initial state:
//   S <- exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T (scale q_t)
// Every sequence starts from its own initial state: nothing flows across cu_seqlens boundaries.
//
// Backward: given d_o [T, Hv, Dv] and d_final_state [N, Hv, Dk, Dv] (or null = zeros), WRITES
// dq, dk [T, Hk, Dk] (summed over the value heads sharing a key head), dv [T, Hv, Dv],
// dg, dbeta [T, Hv], and d_initial_state [N, Hv, Dk, Dv] when not null. Inputs are recomputed.

// Token-by-token recurrence (the spec, qwen35-moe-model.md section 3.4 step 6).
template <typename S>
void gated_delta_rule_recurrent_forward_ref(const GatedDeltaRuleShape& shape, S scale, const S* q,
                                            const S* k, const S* v, const S* g, const S* beta,
                                            const S* initial_state, S* o, S* final_state);

// Reverse-time backward of the recurrence.
// NOTE: keeps the state entering every token of one (sequence, head): len * Dk * Dv scalars of
// scratch, fine for tests; prefer the chunked backward for long sequences.
template <typename S>
void gated_delta_rule_recurrent_backward_ref(const GatedDeltaRuleShape& shape, S scale, const S* q,
                                             const S* k, const S* v, const S* g, const S* beta,
                                             const S* initial_state, const S* d_o,
                                             const S* d_final_state, S* dq, S* dk, S* dv, S* dg,
                                             S* dbeta, S* d_initial_state);

// Chunked (WY/UT) form, qwen35-moe-model.md section 4.1: chunks of chunk_size tokens restart at
// every sequence boundary (a sequence's last chunk may be partial). Same results as the recurrence.
template <typename S>
void gated_delta_rule_chunked_forward_ref(const GatedDeltaRuleShape& shape, S scale, const S* q,
                                          const S* k, const S* v, const S* g, const S* beta,
                                          const S* initial_state, S* o, S* final_state,
                                          int chunk_size = kGatedDeltaRuleChunkSize);

// Intermediates of the chunked form that the overloads below round to bf16 (round to nearest
// even) where a GPU kernel would store them or feed them to a bf16 tensor-core product, to
// measure what bf16 operands cost (gated_delta_rule_precision_test). Everything else, the
// accumulations and the running states included, stays in S. All false: the plain chunked form,
// bit for bit. Per chunk, rows i, j are its tokens, gamma the cumulative log decay inside it.
struct GdnBf16Intermediates {
  bool a = false;        // A = (I + L)^-1 once inverted (backward products) and the coefficients
                         // A diag(beta e^gamma), A diag(beta) of W and U
  bool w = false;        // W (in V_new = U - W H and in the dH update)
  bool u = false;        // U (stored, becomes V_new)
  bool v_new = false;    // V_new (state update, intra output, G = dO V_new^T, dk = V_new dH)
  bool p = false;        // P_ij = (scale q_i . k_j) e^(gamma_i - gamma_j) in P V_new and P^T dO
  bool h = false;        // the state entering each chunk as an operand (a bf16 snapshot: the
                         // running state of the scan stays in S)
  bool q_gated = false;  // e^gamma_i scale q_i in the dH update
  bool dh = false;       // dL/d(state leaving a chunk) as an operand (same: a snapshot)
  bool dv_new = false;   // dV_new (dH update, dW, dA, dv)
  bool local_grads = false;  // the chunk-local gradient operands: dW, dA, dA A^T, G_ij e^(gamma_i
                             // - gamma_j) (dq, dk intra terms) and dL_ij beta_i e^(..) (dk)
};

template <typename S>
void gated_delta_rule_chunked_forward_ref(const GatedDeltaRuleShape& shape, S scale, const S* q,
                                          const S* k, const S* v, const S* g, const S* beta,
                                          const S* initial_state, S* o, S* final_state,
                                          const GdnBf16Intermediates& bf16,
                                          int chunk_size = kGatedDeltaRuleChunkSize);

// Chunked backward as a GPU kernel would do it: recompute the per-chunk WY quantities and the
// chunk-entry states (ceil(len / chunk_size) * Dk * Dv scratch per head, like FLA's h), then a
// reverse scan over chunks carrying d(state) and computing every gradient chunk-locally.
template <typename S>
void gated_delta_rule_chunked_backward_ref(const GatedDeltaRuleShape& shape, S scale, const S* q,
                                           const S* k, const S* v, const S* g, const S* beta,
                                           const S* initial_state, const S* d_o,
                                           const S* d_final_state, S* dq, S* dk, S* dv, S* dg,
                                           S* dbeta, S* d_initial_state,
                                           int chunk_size = kGatedDeltaRuleChunkSize);
template <typename S>
void gated_delta_rule_chunked_backward_ref(const GatedDeltaRuleShape& shape, S scale, const S* q,
                                           const S* k, const S* v, const S* g, const S* beta,
                                           const S* initial_state, const S* d_o,
                                           const S* d_final_state, S* dq, S* dk, S* dv, S* dg,
                                           S* dbeta, S* d_initial_state,
                                           const GdnBf16Intermediates& bf16,
                                           int chunk_size = kGatedDeltaRuleChunkSize);

}  // namespace deltamoe
