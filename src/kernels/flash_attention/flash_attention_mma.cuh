// Tensor-core building blocks of the flash-attention kernels: mma.sync m16n8k16 (bf16 in, fp32
// accumulate, sm_80 and newer), bf16 pair packing, padded shared tiles filled with 16-byte loads,
// and the two warp products of the mma kernels (fragments read as 32-bit pairs).
// Fragment coordinates: lane = 4 * g + t; A rows g and g + 8, columns 2t, 2t + 1 (+ 8); B column g,
// rows 2t, 2t + 1 (+ 8); C rows g and g + 8, columns 2t, 2t + 1.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe::flash_attention_detail {

constexpr int kMmaWarps = 4;
constexpr int kTileRows = 16 * kMmaWarps;  // queries or keys per block and per shared tile
constexpr int kPad = 8;                    // bf16 padding per shared row: fragment rows hit distinct banks
constexpr float kLog2e = 1.4426950408889634f;

__device__ inline void mma_bf16_16x8x16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two floats as a bf16 pair, the first in the low half (the lower column of a fragment).
__device__ inline uint32_t pack_bf16(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

__device__ inline uint32_t load_pair(const uint16_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// Two vertically adjacent bf16 of a shared tile (rows r and r + 1 of one column) as a pair: the B
// fragment when the tile's rows are the reduction index (P V, dS K, P^T dO, dS^T Q).
template <int kStride>
__device__ inline uint32_t load_column_pair(const uint16_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[kStride]) << 16);
}

// Copies `rows` rows of one head of a [T, H, head_dim] bf16 tensor (head_dim a multiple of 8, at
// most kPaddedDim) into shared rows of kPaddedDim + kPad elements with 16-byte accesses; rows at
// or past `limit` and columns past head_dim become zeros (they add nothing to the products).
template <int kPaddedDim>
__device__ inline void load_tile(uint16_t* tile, const __nv_bfloat16* source, int first, int rows, int limit,
                                 int num_heads, int head, int head_dim) {
  constexpr int kVectorsPerRow = kPaddedDim / 8;
  for (int idx = threadIdx.x; idx < rows * kVectorsPerRow; idx += blockDim.x) {
    const int row = idx / kVectorsPerRow, vec = idx - row * kVectorsPerRow;
    const int token = first + row;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (token < limit && vec * 8 < head_dim)
      value = *reinterpret_cast<const uint4*>(source + (static_cast<int64_t>(token) * num_heads + head) * head_dim +
                                              vec * 8);
    *reinterpret_cast<uint4*>(tile + row * (kPaddedDim + kPad) + vec * 8) = value;
  }
}

// Sets C fragments to zero before an accumulation.
template <int kTiles>
__device__ __forceinline__ void zero_fragments(float (&c)[kTiles][4]) {
#pragma unroll
  for (int n = 0; n < kTiles; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
}

// The C fragments of n-tiles 2t and 2t + 1 (16 x 16, fp32) rounded to the bf16 A fragment of
// k-step t: how P and dS pass from one product to the next without shared memory.
template <int kTiles>
__device__ __forceinline__ void accumulators_as_a_fragment(uint32_t (&a)[4], const float (&c)[kTiles][4], int t) {
  a[0] = pack_bf16(c[2 * t][0], c[2 * t][1]);
  a[1] = pack_bf16(c[2 * t][2], c[2 * t][3]);
  a[2] = pack_bf16(c[2 * t + 1][0], c[2 * t + 1][1]);
  a[3] = pack_bf16(c[2 * t + 1][2], c[2 * t + 1][3]);
}

// C (16 x kColumns per warp) = A_rows . B_rows^T over kHeadDim, both row-major shared tiles of
// stride kHeadDim + kPad read as 32-bit pairs: A rows are this warp's 16 rows (a_rows points at
// the first), B rows the kColumns columns of the result (Q K^T, dO V^T, K Q^T, V dO^T).
template <int kHeadDim, int kColumnTiles>
__device__ __forceinline__ void rows_times_rows_t(float (&c)[kColumnTiles][4], const uint16_t* a_rows,
                                                  const uint16_t* b_tile, int group_row, int pair_col) {
  constexpr int kStride = kHeadDim + kPad;
  zero_fragments(c);
#pragma unroll
  for (int s = 0; s < kHeadDim / 16; ++s) {
    const uint16_t* a = a_rows + group_row * kStride + 16 * s + pair_col;
    const uint32_t a0 = load_pair(a), a1 = load_pair(a + 8 * kStride);
    const uint32_t a2 = load_pair(a + 8), a3 = load_pair(a + 8 * kStride + 8);
#pragma unroll
    for (int j = 0; j < kColumnTiles; ++j) {
      // B[d][column] = B_rows[column][d]: column group_row of n-tile j is row 8j + group_row.
      const uint16_t* b = b_tile + (8 * j + group_row) * kStride + 16 * s + pair_col;
      mma_bf16_16x8x16(c[j], a0, a1, a2, a3, load_pair(b), load_pair(b + 8));
    }
  }
}

// acc (16 x kAccDim) += W . tile[:, first_col : first_col + kAccDim], W (16 x 8 * kWeightTiles)
// given as C fragments (rounded to bf16 A fragments here), tile a row-major shared tile of stride
// kHeadDim + kPad whose rows are the reduction index (P V, dS K, P^T dO, dS^T Q).
template <int kHeadDim, int kAccDim, int kWeightTiles>
__device__ __forceinline__ void weights_times_tile(float (&acc)[kAccDim / 8][4], const float (&w)[kWeightTiles][4],
                                                   const uint16_t* tile, int first_col, int group_row, int pair_col) {
  constexpr int kStride = kHeadDim + kPad;
#pragma unroll
  for (int t = 0; t < kWeightTiles / 2; ++t) {
    uint32_t a[4];
    accumulators_as_a_fragment(a, w, t);
    // B[row][d] = tile[row][d]: rows 16t + pair_col (+1) and + 8, column first_col + 8n + group_row.
    const uint16_t* b = tile + (16 * t + pair_col) * kStride + first_col + group_row;
#pragma unroll
    for (int n = 0; n < kAccDim / 8; ++n) {
      const uint16_t* column = b + 8 * n;
      mma_bf16_16x8x16(acc[n], a[0], a[1], a[2], a[3], load_column_pair<kStride>(column),
                       load_column_pair<kStride>(column + 8 * kStride));
    }
  }
}

}  // namespace deltamoe::flash_attention_detail
