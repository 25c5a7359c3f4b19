// CUDA application of the vision tower's interpolated position embedding: the forward adds the 4
// bilinear taps of every patch, read from the fp32 master table, to the bf16 patch embeddings and
// writes the fp32 residual stream (as bf16 autocast does: an fp32 table makes the sum fp32); the backward is a
// deterministic gather per table row over an inverted tap list (no atomics). Legend: N patches,
// C hidden, G grid side (table rows G*G).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe {

// Host helper for the backward: inverts the taps (index int64 [N, 4] from vision_pos_embed_taps)
// into a CSR list per table row. row_offsets int32 [table_rows + 1] and entries int32 [N * 4]
// written (host memory); entries of row g are the tap slots n * 4 + k that read row g, in
// increasing order. Throws on an index outside [0, table_rows).
void vision_pos_embed_invert_taps(const int64_t* index, int64_t num_patches, int64_t table_rows,
                                  int32_t* row_offsets, int32_t* entries);

// table [G*G, C] f32; index int64 [N, 4], weight f32 [N, 4] (device copies of the taps);
// in [N, C] bf16 (the patch embeddings); out [N, C] f32 written:
// out = in + sum_k weight[n, k] * table[index[n, k]].
void vision_pos_embed_forward_cuda(const float* table, const int64_t* index, const float* weight,
                                   const __nv_bfloat16* in, float* out, int64_t num_patches, int64_t hidden,
                                   cudaStream_t stream);

// d_out [N, C] f32; weight f32 [N, 4]; row_offsets, entries: the device copies of
// vision_pos_embed_invert_taps' output. d_table [G*G, C] f32 added to (same bits every run).
void vision_pos_embed_backward_cuda(const float* d_out, const float* weight, const int32_t* row_offsets,
                                    const int32_t* entries, float* d_table, int64_t num_patches, int64_t table_rows,
                                    int64_t hidden, cudaStream_t stream);

}  // namespace deltamoe
