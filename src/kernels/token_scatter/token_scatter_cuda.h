// CUDA placement of image features into the <|image_pad|> rows of the text embedding, and its
// backward (gather of those rows' gradient, then zeroing them). The pad rows are listed once on
// the host, where the token ids are known, so the kernels are plain row copies.
// Legend: T tokens, N feature rows, C hidden.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe {

// Host helper: pad_rows int32 [N] written (host memory) with the token index of every id equal
// to token_id, in order. Throws unless exactly N ids equal token_id (as the reference does).
void token_scatter_pad_rows(const int64_t* ids, int64_t num_tokens, int64_t token_id, int64_t num_features,
                            int32_t* pad_rows);

// pad_rows int32 [N] (device copy of the above); features [N, C] bf16 (the vision tower's
// output); embeds [T, C] f32 (the embedding stream) updated in place: row pad_rows[i] = features[i].
void token_scatter_forward_cuda(const int32_t* pad_rows, const __nv_bfloat16* features, int64_t num_features,
                                float* embeds, int64_t num_tokens, int64_t hidden, cudaStream_t stream);

// d_embeds [T, C] f32 in and out: d_features [N, C] bf16 written with row pad_rows[i] of d_embeds
// (rounded), and those rows of d_embeds then zeroed (the lookup's values there were replaced).
void token_scatter_backward_cuda(const int32_t* pad_rows, float* d_embeds, __nv_bfloat16* d_features,
                                 int64_t num_features, int64_t num_tokens, int64_t hidden, cudaStream_t stream);

}  // namespace deltamoe
