// Load-balancing auxiliary loss of transformers' load_balancing_loss_func (current form), pooled
// over all layers and tokens: aux = E * sum_e f_e * P_e with f_e = (# rows selecting e) / R and
// P_e = (sum of p_r[e]) / R, R = layers x tokens. Gradient flows through P only.
// Legend: R rows (tokens of one layer; layers are added one call at a time), E experts, K top-k.
#pragma once

#include <cstdint>
#include <vector>

namespace deltamoe {

// Running sums over all layers: selection counts and probability sums per expert, and R.
struct MoeAuxStats {
  std::vector<double> selected_count;  // [E]
  std::vector<double> prob_sum;        // [E]
  int64_t num_rows = 0;                // R
};

// Adds one layer's rows: probs [R, E] (router softmax), topk_idx int32 [R, K].
template <typename T>
void moe_aux_loss_accumulate_ref(const T* probs, const int32_t* topk_idx, int64_t rows, int64_t num_experts,
                                 int64_t top_k, MoeAuxStats* stats);

// aux = E * sum_e (count_e / R) * (prob_sum_e / R); 0 when no rows.
double moe_aux_loss_value(const MoeAuxStats& stats);

// One layer's d_logits [R, E] written for a loss d_aux * aux; probs [R, E] of that layer.
template <typename T>
void moe_aux_loss_backward_ref(const T* probs, const MoeAuxStats& stats, T d_aux, T* d_logits, int64_t rows);

}  // namespace deltamoe
