// Per-row bookkeeping shared by the tensor-core flash-attention kernels (mma and wide):
// D = 256): which keys (queries) each of a thread's two fragment rows may see, the forward's
// online-softmax step, the dQ pass's dS, and the stores of C fragment rows (O and lse, dQ, dK, dV).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/flash_attention/flash_attention_common.cuh"
#include "kernels/flash_attention/flash_attention_cuda.h"
#include "kernels/flash_attention/flash_attention_mma.cuh"

namespace deltamoe::flash_attention_detail {

// A block's query tile [first_query, first_query + rows) and this thread's two fragment rows
// (first_query + row0 + group_row and + 8): row r sees keys [key_begin[r], key_limit[r]), an empty
// range for rows past T; the block as a whole sees keys [block_key_begin, block_key_end).
struct QueryRows {
  int last_query;  // the tile's last valid query
  int query[2];
  int key_begin[2];
  int key_limit[2];
  int block_key_begin;
  int block_key_end;
};

__device__ __forceinline__ QueryRows query_rows(const FlashAttentionShape& shape, int first_query, int rows,
                                                int row0, int group_row) {
  const int num_tokens = static_cast<int>(shape.num_tokens), num_segments = static_cast<int>(shape.num_segments);
  QueryRows q;
  q.last_query = min(first_query + rows, num_tokens) - 1;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int query = first_query + row0 + group_row + 8 * r;
    q.query[r] = query;
    const Segment segment = find_segment(shape.cu_seqlens, num_segments, min(query, q.last_query));
    q.key_begin[r] = segment.begin;
    q.key_limit[r] = query >= num_tokens ? segment.begin : shape.causal ? query + 1 : segment.end;
  }
  q.block_key_begin = find_segment(shape.cu_seqlens, num_segments, first_query).begin;
  q.block_key_end =
      shape.causal ? q.last_query + 1 : find_segment(shape.cu_seqlens, num_segments, q.last_query).end;
  return q;
}

// The dQ pass's per-row statistics: lse (in log2 units) and delta of the two rows; rows past T
// read the tile's last valid row (their products are masked out anyway).
__device__ __forceinline__ void load_row_stats(float (&row_lse)[2], float (&row_delta)[2], const QueryRows& rows,
                                               int num_tokens, int num_q_heads, int head, const float* lse,
                                               const float* delta) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int query = rows.query[r];
    const int64_t stat = static_cast<int64_t>(query < num_tokens ? query : rows.last_query) * num_q_heads + head;
    row_lse[r] = lse[stat] * kLog2e;
    row_delta[r] = delta[stat];
  }
}

// The dQ pass's dS over a key tile starting at key0, written over the S fragments: P = exp2(S
// scale - lse) on visible keys, dS = P (dP - delta) before the softmax scale.
template <int kKeyTiles>
__device__ __forceinline__ void dscore_step(float (&score)[kKeyTiles][4], const float (&d_prob)[kKeyTiles][4],
                                            const QueryRows& rows, const float (&row_lse)[2],
                                            const float (&row_delta)[2], int key0, int pair_col,
                                            float score_scale) {
#pragma unroll
  for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2, key = key0 + 8 * j + pair_col + (e % 2);
      const bool visible = key >= rows.key_begin[r] && key < rows.key_limit[r];
      const float p = visible ? exp2f(score[j][e] * score_scale - row_lse[r]) : 0.0f;
      score[j][e] = p * (d_prob[j][e] - row_delta[r]);  // dS, before the scale
    }
  }
}

// The dK/dV pass's key tile [first_key, first_key + rows) and this thread's two fragment rows
// (first_key + row0 + group_row and + 8): key j is seen by queries [causal ? j : segment.begin,
// segment.end), none for rows past T; the block as a whole by [block_query_begin, block_query_end).
struct KeyRows {
  int key[2];
  int query_from[2];
  int query_to[2];
  int block_query_begin;
  int block_query_end;
};

__device__ __forceinline__ KeyRows key_rows(const FlashAttentionShape& shape, int first_key, int rows, int row0,
                                            int group_row) {
  const int num_tokens = static_cast<int>(shape.num_tokens), num_segments = static_cast<int>(shape.num_segments);
  const int last_key = min(first_key + rows, num_tokens) - 1;
  KeyRows k;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = first_key + row0 + group_row + 8 * r;
    const Segment segment = find_segment(shape.cu_seqlens, num_segments, min(key, last_key));
    k.key[r] = key;
    k.query_from[r] = shape.causal ? key : segment.begin;
    k.query_to[r] = key < num_tokens ? segment.end : 0;
  }
  k.block_query_begin = shape.causal ? first_key : find_segment(shape.cu_seqlens, num_segments, first_key).begin;
  k.block_query_end = find_segment(shape.cu_seqlens, num_segments, last_key).end;
  return k;
}

// One online-softmax step of the forward over a key tile starting at key0 (C fragments of S,
// unscaled): masks and scales the scores (log2 units), raises the row maxima, rescales the O
// accumulators and this lane's row sums, and leaves P = exp2(S - max) in `score`.
template <int kKeyTiles, int kDimTiles>
__device__ __forceinline__ void online_softmax_step(float (&score)[kKeyTiles][4], float (&acc)[kDimTiles][4],
                                                    float (&row_max)[2], float (&row_sum)[2],
                                                    const QueryRows& rows, int key0, int pair_col,
                                                    float score_scale) {
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2, key = key0 + 8 * j + pair_col + (e % 2);
      const bool visible = key >= rows.key_begin[r] && key < rows.key_limit[r];
      score[j][e] = visible ? score[j][e] * score_scale : -INFINITY;
      tile_max[r] = fmaxf(tile_max[r], score[j][e]);
    }
  }
  float correction[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
    const float new_max = fmaxf(row_max[r], tile_max[r]);
    // Rows with nothing visible yet keep max -inf; guard the -inf - -inf cases.
    correction[r] = row_max[r] == -INFINITY ? 0.0f : exp2f(row_max[r] - new_max);
    row_max[r] = new_max;
    row_sum[r] *= correction[r];
  }
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) {
    acc[n][0] *= correction[0];
    acc[n][1] *= correction[0];
    acc[n][2] *= correction[1];
    acc[n][3] *= correction[1];
  }
#pragma unroll
  for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2;
      const float p = score[j][e] == -INFINITY ? 0.0f : exp2f(score[j][e] - row_max[r]);
      score[j][e] = p;
      row_sum[r] += p;
    }
  }
}

// Row r of C fragments times `multiplier` as bf16 pairs at dst + 8n (dst already points at this
// lane's column pair of the row); columns first_col + 8n at or past head_dim (padding) are skipped.
template <int kTiles>
__device__ __forceinline__ void store_fragment_row(__nv_bfloat16* dst, const float (&acc)[kTiles][4], int r,
                                                   float multiplier, int first_col, int head_dim) {
#pragma unroll
  for (int n = 0; n < kTiles; ++n) {
    if (first_col + 8 * n >= head_dim) break;  // head_dim is a multiple of 8
    *reinterpret_cast<__nv_bfloat162*>(dst + 8 * n) =
        __floats2bfloat162_rn(acc[n][2 * r] * multiplier, acc[n][2 * r + 1] * multiplier);
  }
}

// The forward's epilogue: adds up the 4 lanes' row sums, stores O = acc / row_sum for the valid
// rows and lse = max + log(sum) in natural-log units (one lane per row).
template <int kDimTiles>
__device__ __forceinline__ void store_forward_rows(const float (&acc)[kDimTiles][4], const float (&row_max)[2],
                                                   float (&row_sum)[2], const QueryRows& rows, int num_tokens,
                                                   int num_q_heads, int head, int head_dim, int lane, int pair_col,
                                                   __nv_bfloat16* out, float* lse) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int query = rows.query[r];
    if (query >= num_tokens) continue;
    // A valid row always sees its own key (causal) or its non-empty segment: row_sum > 0.
    const float inverse_sum = 1.0f / row_sum[r];
    __nv_bfloat16* out_row = out + (static_cast<int64_t>(query) * num_q_heads + head) * head_dim + pair_col;
    store_fragment_row(out_row, acc, r, inverse_sum, 0, head_dim);
    if (lane % 4 == 0)
      lse[static_cast<int64_t>(query) * num_q_heads + head] = row_max[r] / kLog2e + logf(row_sum[r]);
  }
}

// The dQ pass's epilogue: dQ = scale * acc for the valid rows.
template <int kDimTiles>
__device__ __forceinline__ void store_dq_rows(const float (&dq_acc)[kDimTiles][4], const QueryRows& rows,
                                              int num_tokens, int num_q_heads, int head, int head_dim, int pair_col,
                                              float scale, __nv_bfloat16* dq) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows.query[r] >= num_tokens) continue;
    __nv_bfloat16* dq_row = dq + (static_cast<int64_t>(rows.query[r]) * num_q_heads + head) * head_dim + pair_col;
    store_fragment_row(dq_row, dq_acc, r, scale, 0, head_dim);
  }
}

// The dK/dV pass's epilogue for keys row_key[0..1]: dK = scale * dk_acc, dV = dv_acc, columns
// first_col + 8n of the head dim (this block's or warp's slice).
template <int kAccTiles>
__device__ __forceinline__ void store_dk_dv_rows(const float (&dk_acc)[kAccTiles][4],
                                                 const float (&dv_acc)[kAccTiles][4], const int (&row_key)[2],
                                                 int num_tokens, int num_kv_heads, int kv_head, int head_dim,
                                                 int first_col, int pair_col, float scale, __nv_bfloat16* dk,
                                                 __nv_bfloat16* dv) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row_key[r] >= num_tokens) continue;
    const int64_t offset =
        (static_cast<int64_t>(row_key[r]) * num_kv_heads + kv_head) * head_dim + first_col + pair_col;
#pragma unroll
    for (int n = 0; n < kAccTiles; ++n) {
      if (first_col + 8 * n >= head_dim) break;  // padding columns
      *reinterpret_cast<__nv_bfloat162*>(dk + offset + 8 * n) =
          __floats2bfloat162_rn(dk_acc[n][2 * r] * scale, dk_acc[n][2 * r + 1] * scale);
      *reinterpret_cast<__nv_bfloat162*>(dv + offset + 8 * n) =
          __floats2bfloat162_rn(dv_acc[n][2 * r], dv_acc[n][2 * r + 1]);
    }
  }
}

}  // namespace deltamoe::flash_attention_detail
