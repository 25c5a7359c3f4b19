// Qwen3.5-MoE router after its projection: p = softmax(logits) per token, pick the top K experts,
// renormalise their probabilities to sum to one. The projection itself is a linear op.
// Legend: T tokens, E experts, K experts per token.
#pragma once

#include <cstdint>

namespace deltamoe {

// logits [T, E] -> probs [T, E], topk_idx int32 [T, K] (descending probability, ties to the lower
// expert index), topk_weight [T, K] (renormalised); all written.
template <typename T>
void moe_router_forward_ref(const T* logits, T* probs, int32_t* topk_idx, T* topk_weight, int64_t num_tokens,
                            int64_t num_experts, int64_t top_k);

// The same with the choice given: topk_idx int32 [T, K] is read (each in [0, E)), probs and
// topk_weight written. Lets a test or a GPU-vs-CPU comparison pin the routing across near-ties.
template <typename T>
void moe_router_forward_given_choice_ref(const T* logits, T* probs, const int32_t* topk_idx, T* topk_weight,
                                         int64_t num_tokens, int64_t num_experts, int64_t top_k);

// d_topk_weight [T, K] -> d_logits [T, E] written. The selection itself carries no gradient.
template <typename T>
void moe_router_backward_ref(const T* probs, const int32_t* topk_idx, const T* topk_weight, const T* d_topk_weight,
                             T* d_logits, int64_t num_tokens, int64_t num_experts, int64_t top_k);

// Row-wise softmax backward: d_logits = p * (d_p - sum(p * d_p)); d_logits [rows, E] written.
template <typename T>
void softmax_backward_rows_ref(const T* probs, const T* d_probs, T* d_logits, int64_t rows, int64_t width);

}  // namespace deltamoe
