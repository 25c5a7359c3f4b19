// Routed experts of the Qwen3.5-MoE block in the fused in-memory layout: for each token and each of
// its K selected experts e, gu = gate_up[e] x (rows [0, I) gate, [I, 2I) up), h = silu(gate) * up,
// y += w * down[e] h. Legend: T tokens, C hidden, E experts, K experts per token, I expert width.
#pragma once

#include <cstdint>
#include <vector>

namespace deltamoe {

struct MoeExpertsDims {
  int64_t num_tokens = 0;    // T
  int64_t hidden = 0;        // C
  int64_t num_experts = 0;   // E
  int64_t top_k = 0;         // K
  int64_t intermediate = 0;  // I
};

// x [T, C]; topk_idx int32 [T, K]; topk_weight [T, K]; gate_up [E, 2I, C]; down [E, C, I];
// y [T, C] written.
template <typename T>
void moe_experts_forward_ref(const MoeExpertsDims& dims, const T* x, const int32_t* topk_idx, const T* topk_weight,
                             const T* gate_up, const T* down, T* y);

// dy [T, C] -> dx [T, C] and d_topk_weight [T, K] written (a token's dx is the sum, in slot order
// starting from zero, of its K per-slot rows moe_expert_row_backward_ref forms; an expert on another
// rank returns exactly such a row, so expert parallelism changes no rounding); d_gate_up [E, 2I, C] and d_down [E, C, I]
// added to (each may be null: not computed, e.g. frozen experts; that skips the weight-gradient
// products). Expert activations are recomputed, not saved.
template <typename T>
void moe_experts_backward_ref(const MoeExpertsDims& dims, const T* x, const int32_t* topk_idx, const T* topk_weight,
                              const T* gate_up, const T* down, const T* dy, T* dx, T* d_topk_weight, T* d_gate_up,
                              T* d_down);

// One routed (token, slot) row, the unit both the whole-batch functions above and expert parallelism
// (src/parallel/expert_dispatch.h: the expert's owner computes rows of tokens of other ranks) are made
// of. Scratch buffers are the caller's so that a loop over rows allocates nothing.
template <typename T>
struct MoeExpertRowScratch {
  std::vector<T> gu, h, dh, d_gu;
};

// y_e [C] = down[e] (silu(gate) * up) for x_row [C], before the routing weight; written.
template <typename T>
void moe_expert_row_forward_ref(const MoeExpertsDims& dims, const T* x_row, int64_t expert, const T* gate_up,
                                const T* down, T* y_e, MoeExpertRowScratch<T>& scratch);

// The gradient of weight * y_e with respect to x_row for the incoming dy_row: dx_row [C] written,
// *d_weight = <dy_row, y_e> written; d_gate_up / d_down (whole [E, ...] tensors, or null) added to
// in the same order as moe_experts_backward_ref adds them.
template <typename T>
void moe_expert_row_backward_ref(const MoeExpertsDims& dims, const T* x_row, int64_t expert, T weight,
                                 const T* dy_row, const T* gate_up, const T* down, T* dx_row, T* d_weight,
                                 T* d_gate_up, T* d_down, MoeExpertRowScratch<T>& scratch);

}  // namespace deltamoe
