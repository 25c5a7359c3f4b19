// Device helpers shared by the flash-attention kernels: which packed segment a token belongs to,
// the per-row thread layout (kThreadsPerRow lanes split the head dim), and lane reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe::flash_attention_detail {

// Lanes that share one query (or key) row; they hold interleaved slices d = lane + 8 * c of the
// head dim and combine dot products with three butterfly shuffles (lanes of a row are adjacent).
constexpr int kThreadsPerRow = 8;
constexpr int kThreadsPerBlock = 256;
constexpr int kRowsPerBlock = kThreadsPerBlock / kThreadsPerRow;  // 32 query or key rows per block

struct Segment {
  int begin;
  int end;  // exclusive
};

// The segment holding token t: the largest s < num_segments with cu_seqlens[s] <= t. Empty
// segments before a non-empty one are skipped because their start equals the next one's.
__device__ inline Segment find_segment(const int32_t* cu_seqlens, int num_segments, int token) {
  int lo = 0, hi = num_segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_seqlens[mid] <= token) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return Segment{cu_seqlens[lo], cu_seqlens[lo + 1]};
}

// Sum over the kThreadsPerRow lanes of a row; every lane of the row receives the total.
__device__ inline float row_sum(float value) {
#pragma unroll
  for (int offset = 1; offset < kThreadsPerRow; offset *= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// Copies rows [first, first + count) of one head of a [T, H, D] bf16 tensor into shared memory
// [kRowsPerBlock or fewer rows, D]; rows at or past `limit` are filled with zeros.
__device__ inline void load_rows(__nv_bfloat16* tile, const __nv_bfloat16* source, int first, int count, int limit,
                                 int num_heads, int head, int head_dim) {
  const __nv_bfloat16 zero = __float2bfloat16(0.0f);
  for (int idx = threadIdx.x; idx < count * head_dim; idx += blockDim.x) {
    const int row = idx / head_dim, d = idx - row * head_dim;
    const int token = first + row;
    tile[idx] = token < limit ? source[(static_cast<int64_t>(token) * num_heads + head) * head_dim + d] : zero;
  }
}

}  // namespace deltamoe::flash_attention_detail
