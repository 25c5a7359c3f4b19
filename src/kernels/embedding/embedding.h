// Token embedding lookup: out[t] = table[ids[t]] (no scaling), and its backward (scatter-add).
// Legend: T tokens, V vocabulary rows, C hidden.
#pragma once

#include <cstdint>

namespace deltamoe {

// ids int64 [T] in [0, V); table [V, C]; out [T, C] written. Throws on an id out of range.
template <typename T>
void embedding_forward_ref(const int64_t* ids, const T* table, T* out, int64_t num_tokens, int64_t vocab,
                           int64_t hidden);

// d_out [T, C]; d_table [V, C] added to (rows of repeated ids accumulate).
template <typename T>
void embedding_backward_ref(const int64_t* ids, const T* d_out, T* d_table, int64_t num_tokens, int64_t vocab,
                            int64_t hidden);

}  // namespace deltamoe
