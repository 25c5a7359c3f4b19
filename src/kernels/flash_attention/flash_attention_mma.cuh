// Tensor-core building blocks of the flash-attention kernels: mma.sync m16n8k16 (bf16 in, fp32
// accumulate, sm_80 and newer), bf16 pair packing, and padded shared tiles filled with 16-byte loads.
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

}  // namespace deltamoe::flash_attention_detail
