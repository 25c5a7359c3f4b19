// CUDA token embedding lookup and its backward (a deterministic fp32 sum per table row). The
// rows are copied from the fp32 master table into the fp32 residual stream, as bf16 autocast does
// (an fp32 parameter keeps the embedding output fp32). Legend: T tokens, V vocabulary rows, C hidden.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe {

// ids int64 [T]; table [V, C] f32; out [T, C] f32 written. An id outside [0, V) gives a zero
// row and, when bad_id_position is non-null (int32 device scalar, zeroed by the caller), stores
// 1 + the position of one such token there, for the caller to report after its next sync.
void embedding_forward_cuda(const int64_t* ids, const float* table, float* out, int64_t num_tokens,
                            int64_t vocab, int64_t hidden, int32_t* bad_id_position, cudaStream_t stream);

// d_out [T, C] f32; d_table [V, C] f32 added to. The tokens come grouped by id
// (embedding_grad_plan.h, on the device): sorted_tokens int32 [T], segment_offsets int32 [U+1],
// segment_ids int64 [U]. Each row of the table sums its tokens in position order, so every run
// rounds alike (no atomics).
void embedding_backward_cuda(const int32_t* sorted_tokens, const int32_t* segment_offsets,
                             const int64_t* segment_ids, int64_t num_segments, const float* d_out, float* d_table,
                             int64_t hidden, cudaStream_t stream);

}  // namespace deltamoe
