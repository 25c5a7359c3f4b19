// Plain CPU reference of the token embedding lookup and its gradient.
#include "kernels/embedding/embedding.h"

#include "core/error.h"

namespace deltamoe {

template <typename T>
void embedding_forward_ref(const int64_t* ids, const T* table, T* out, int64_t num_tokens, int64_t vocab,
                           int64_t hidden) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t id = ids[t];
    CHECK(id >= 0 && id < vocab, "embedding: token id ", id, " at position ", t, " is outside the vocabulary [0, ",
          vocab, ")");
    for (int64_t c = 0; c < hidden; ++c) out[t * hidden + c] = table[id * hidden + c];
  }
}

template <typename T>
void embedding_backward_ref(const int64_t* ids, const T* d_out, T* d_table, int64_t num_tokens, int64_t vocab,
                            int64_t hidden) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t id = ids[t];
    CHECK(id >= 0 && id < vocab, "embedding: token id ", id, " at position ", t, " is outside the vocabulary [0, ",
          vocab, ")");
    for (int64_t c = 0; c < hidden; ++c) d_table[id * hidden + c] += d_out[t * hidden + c];
  }
}

#define INSTANTIATE(T)                                                                             \
  template void embedding_forward_ref<T>(const int64_t*, const T*, T*, int64_t, int64_t, int64_t); \
  template void embedding_backward_ref<T>(const int64_t*, const T*, T*, int64_t, int64_t, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace deltamoe
