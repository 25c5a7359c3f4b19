// Causal-LM loss as transformers computes it: labels shifted left by one (the label at t + 1
// supervises the logits at t), cross-entropy with ignore index -100, mean over supervised tokens.
// Legend: B rows, S positions per row, T = B * S tokens, V vocabulary.
#pragma once

#include <cstdint>

namespace deltamoe {

constexpr int64_t kIgnoreIndex = -100;

// labels int64 [B, S] -> shifted int64 [B, S] written: shifted[b, s] = labels[b, s + 1], the last
// position of each row -100. Packed rows shift across sequence boundaries exactly like transformers;
// the packer marks each sequence's first label -100 so nothing is learned across a boundary.
void shift_labels_ref(const int64_t* labels, int64_t* shifted, int64_t rows, int64_t seq_len);

// logits [T, V]; labels int64 [T] (already shifted; each -100 or in [0, V)); lse [T] written.
// Returns the mean loss over supervised tokens (0 when none), summed in fp64 so that the value
// itself adds no rounding, and writes their count.
template <typename T>
double cross_entropy_forward_ref(const T* logits, const int64_t* labels, T* lse, int64_t num_tokens, int64_t vocab,
                                 int64_t* num_supervised);

// d_logits [T, V] written: d_loss * (softmax - onehot) / num_supervised on supervised rows, 0 elsewhere.
template <typename T>
void cross_entropy_backward_ref(const T* logits, const int64_t* labels, const T* lse, T d_loss, T* d_logits,
                                int64_t num_tokens, int64_t vocab);

}  // namespace deltamoe
