// Placing image features into the text embedding: the rows whose token id is the image (or video)
// pad id are overwritten, in order, by the feature rows (transformers' masked_scatter).
// Legend: T tokens, N feature rows, C hidden.
#pragma once

#include <cstdint>

namespace deltamoe {

// ids int64 [T]; features [N, C]; embeds [T, C] updated in place. Throws unless exactly N ids
// equal token_id.
template <typename T>
void token_scatter_forward_ref(const int64_t* ids, int64_t num_tokens, int64_t token_id, const T* features,
                               int64_t num_features, T* embeds, int64_t hidden);

// d_embeds [T, C] in, and out: d_features [N, C] written from the pad rows, whose gradient in
// d_embeds is then zeroed (the lookup's values there were replaced, so they get none).
template <typename T>
void token_scatter_backward_ref(const int64_t* ids, int64_t num_tokens, int64_t token_id, T* d_embeds,
                                T* d_features, int64_t num_features, int64_t hidden);

}  // namespace deltamoe
