// The workspace layout of the CUDA gated delta rule (gated_delta_rule_cuda.h) in plain C++: the
// CUDA files carve it and the CPU memory planner (src/train/memory_plan.cc) sizes it with this
// one function, so that the two agree to the byte.
//
// What is stored per token, per chunk and per chunk boundary (T tokens, N sequences, Hv value
// heads, head dims Dk, Dv, chunks of 64 tokens that restart at every sequence):
//   per token:    gamma, W, U / V_new, and the rows of the chunk's 64 x 64 matrices P and
//                 A = (I + L)^-1 (row i of a chunk belongs to its token i; rows past a partial
//                 chunk's end are zero and are not stored); backward adds dV_new, dW, d gamma per
//                 value head and the fp32 sums of dq, dk per key head (Hk).
// The forward's arrays come first and the backward's after them, so a forward's workspace is the
// head of the backward's; the backward only reads the forward's arrays, so a caller may keep a
// forward's workspace and hand it to the backward in place of recomputing it
// (gated_delta_rule_backward_after_forward_cuda).
// The operands of the kernels' products (W / dW, U / V_new, P, A, the boundary states and their
// gradients, dV_new) are stored in bf16, as the products take them; the gates and the
// accumulated dq, dk, d gamma in fp32 (gated_delta_rule_notes.md, "bf16 intermediates").
//   per chunk:    the chunk table (20 bytes an entry), T/64 + N entries.
//   per boundary: the state [Hv, Dk, Dv] between two chunks of one sequence, as the bf16 operand
//                 of the next chunk's products (forward), and its gradient (backward). A chunk that begins a sequence enters with the
//                 sequence's initial state and the last one leaves with its final state, so only
//                 the boundaries inside sequences take a slot: sum over sequences of
//                 ceil(len / 64) - 1 <= (T - 1) / 64 however many sequences there are.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/gated_delta_rule/gated_delta_rule.h"

namespace deltamoe {

struct GatedDeltaRuleWorkspaceLayout {
  // Byte offsets from the (256-byte aligned) base; the backward-only arrays are 0 in the forward.
  size_t chunks = 0;         // ChunkInfo [max_chunks]
  size_t chunk_count = 0;    // int [1]
  size_t chunk_offsets = 0;  // int [N + 1]: first chunk of each sequence
  size_t slot_offsets = 0;   // int [N + 1]: first state slot of each sequence
  size_t gamma = 0;          // float [T, Hv]
  size_t w = 0;              // bf16 [T, Hv, Dk]
  size_t v_new = 0;          // bf16 [T, Hv, Dv]
  size_t p = 0;              // bf16 [T, Hv, 64]
  size_t a_inv = 0;          // bf16 [T, Hv, 64]
  size_t h = 0;              // bf16 [state_slots, Hv, Dk, Dv]
  size_t dh = 0;             // bf16 [state_slots, Hv, Dk, Dv]
  size_t dv_new = 0;         // bf16 [T, Hv, Dv]
  size_t dw = 0;             // bf16 [T, Hv, Dk]
  size_t dq_acc = 0;         // float [T, Hk, Dk]: summed over the key head's value heads
  size_t dk_acc = 0;         // float [T, Hk, Dk]
  size_t dgamma = 0;         // float [T, Hv]
  size_t total = 0;          // bytes the whole layout needs
  size_t forward_total = 0;  // bytes of the forward's arrays (where the backward's begin)
};

// Bytes of one chunk-table entry (t0, len, seq, h_slot, dh_slot; the CUDA side asserts it).
constexpr size_t kGatedDeltaRuleChunkInfoBytes = 5 * sizeof(int32_t);

// Chunk-table entries: T / 64 full chunks plus at most one partial chunk per sequence.
inline int64_t gated_delta_rule_max_chunks(int64_t num_tokens, int64_t num_seqs) {
  return num_tokens / kGatedDeltaRuleChunkSize + num_seqs;
}

// State slots: the chunk boundaries inside sequences, at most (T - 1) / 64 (a sequence of len
// tokens has ceil(len / 64) - 1 = floor((len - 1) / 64) of them, and the len - 1 add up to at
// most T - 1 when any sequence is non-empty).
inline int64_t gated_delta_rule_max_state_slots(int64_t num_tokens) {
  return num_tokens > 0 ? (num_tokens - 1) / kGatedDeltaRuleChunkSize : 0;
}

// The layout for T tokens in N sequences with Hk key and Hv value heads of dims Dk, Dv, for the
// forward or the backward (which also recomputes the forward in the same workspace).
inline GatedDeltaRuleWorkspaceLayout gated_delta_rule_workspace_layout(int64_t num_tokens, int64_t num_seqs,
                                                                       int64_t key_heads, int64_t value_heads,
                                                                       int64_t key_dim, int64_t value_dim,
                                                                       bool backward) {
  const int64_t T = num_tokens, Hk = key_heads, Hv = value_heads, Dk = key_dim, Dv = value_dim;
  const int64_t slots = gated_delta_rule_max_state_slots(T);
  GatedDeltaRuleWorkspaceLayout layout;
  size_t offset = 0;
  auto take = [&](int64_t bytes) {
    const size_t at = offset;
    offset += (static_cast<size_t>(bytes) + 255) / 256 * 256;
    return at;
  };
  constexpr int64_t F = sizeof(float), B = 2 /* bf16 */, I = sizeof(int32_t);
  layout.chunks = take(static_cast<int64_t>(kGatedDeltaRuleChunkInfoBytes) *
                       gated_delta_rule_max_chunks(T, num_seqs));
  layout.chunk_count = take(I);
  layout.chunk_offsets = take(I * (num_seqs + 1));
  layout.slot_offsets = take(I * (num_seqs + 1));
  layout.gamma = take(F * T * Hv);
  layout.w = take(B * T * Hv * Dk);
  layout.v_new = take(B * T * Hv * Dv);
  layout.p = take(B * T * Hv * kGatedDeltaRuleChunkSize);
  layout.a_inv = take(B * T * Hv * kGatedDeltaRuleChunkSize);
  layout.h = take(B * slots * Hv * Dk * Dv);
  layout.forward_total = offset;
  if (backward) {
    layout.dh = take(B * slots * Hv * Dk * Dv);
    layout.dv_new = take(B * T * Hv * Dv);
    layout.dw = take(B * T * Hv * Dk);
    layout.dq_acc = take(F * T * Hk * Dk);
    layout.dk_acc = take(F * T * Hk * Dk);
    layout.dgamma = take(F * T * Hv);
  }
  layout.total = offset;
  return layout;
}

}  // namespace deltamoe
