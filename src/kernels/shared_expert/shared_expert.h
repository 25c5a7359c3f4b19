// Shared expert of the Qwen3.5-MoE block with its scalar sigmoid gate:
// y = sigmoid(x . w_gate) * down(silu(gate_proj x) * up_proj x).
// Legend: T tokens, C hidden, I shared expert width (Is).
#pragma once

#include <cstdint>

namespace deltamoe {

// x [T, C]; gate_proj and up_proj [I, C]; down_proj [C, I]; expert_gate [1, C]; y [T, C] written.
template <typename T>
void shared_expert_forward_ref(const T* x, const T* gate_proj, const T* up_proj, const T* down_proj,
                               const T* expert_gate, T* y, int64_t num_tokens, int64_t hidden, int64_t intermediate);

// dy [T, C] -> dx [T, C] written; d_gate_proj, d_up_proj, d_down_proj, d_expert_gate added to (each
// may be null: not computed, e.g. a frozen expert). Activations are recomputed from x.
template <typename T>
void shared_expert_backward_ref(const T* x, const T* gate_proj, const T* up_proj, const T* down_proj,
                                const T* expert_gate, const T* dy, T* dx, T* d_gate_proj, T* d_up_proj, T* d_down_proj,
                                T* d_expert_gate, int64_t num_tokens, int64_t hidden, int64_t intermediate);

}  // namespace deltamoe
