// Building blocks of the pipelined flash-attention kernels (flash_attention_*_wide.cu): cp.async
// 16-byte copies global -> shared with zero fill, and ldmatrix fragment loads (plain and .trans)
// of m16n8k16 operands from padded row-major shared tiles, and the warp products built on them.
// sm_80 and newer.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/flash_attention/flash_attention_mma.cuh"

namespace deltamoe::flash_attention_detail {

__device__ inline uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes, or writes 16 zero bytes when `valid` is false (source not read then).
__device__ inline void cp_async_16(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared)), "l"(global),
               "r"(valid ? 16 : 0));
}

// Copies 4 bytes, or writes a zero word when `valid` is false.
__device__ inline void cp_async_4(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(shared)), "l"(global),
               "r"(valid ? 4 : 0));
}

__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ inline void cp_async_wait() {
  // The clobber keeps the compiler from moving ordinary shared-memory reads above the wait.
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 bf16 matrices; lane L supplies the row address of matrix L / 8.
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], const uint16_t* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

// A fragment (16 x 16, rows row0.., columns col0..) of a row-major shared tile.
template <int kStride>
__device__ inline void load_a_fragment(uint32_t (&a)[4], const uint16_t* tile, int row0, int col0, int lane) {
  ldmatrix_x4(a, tile + (row0 + lane % 16) * kStride + col0 + (lane / 16) * 8);
}

// B fragments of two adjacent n-tiles where B[k][n] = tile[n][k] (tile rows are the n index:
// K in Q K^T): b[0], b[1] for columns n0..n0+7, b[2], b[3] for n0+8..n0+15; k from k0.
template <int kStride>
__device__ inline void load_b_fragments_from_rows(uint32_t (&b)[4], const uint16_t* tile, int n0, int k0,
                                                  int lane) {
  ldmatrix_x4(b, tile + (n0 + lane % 8 + (lane / 16) * 8) * kStride + k0 + ((lane / 8) % 2) * 8);
}

// B fragments of two adjacent n-tiles where B[k][n] = tile[k][n] (tile rows are the reduction
// index: V in P V, K in dS K, dO in P^T dO): same register order as above.
template <int kStride>
__device__ inline void load_b_fragments_from_columns(uint32_t (&b)[4], const uint16_t* tile, int k0, int n0,
                                                     int lane) {
  ldmatrix_x4_trans(b, tile + (k0 + lane % 16) * kStride + n0 + (lane / 16) * 8);
}

// Issues cp.async copies of `rows` rows of one head of a [T, H, head_dim] bf16 tensor into shared
// rows of kStride elements (kPaddedDim used columns); rows at or past `limit` and columns past
// head_dim (a multiple of 8) are zero-filled. Threads of the block share the work.
template <int kPaddedDim, int kStride>
__device__ inline void issue_tile_copy(uint16_t* tile, const __nv_bfloat16* source, int first, int rows, int limit,
                                       int num_heads, int head, int head_dim) {
  constexpr int kVectorsPerRow = kPaddedDim / 8;
  for (int idx = threadIdx.x; idx < rows * kVectorsPerRow; idx += blockDim.x) {
    const int row = idx / kVectorsPerRow, vec = idx - row * kVectorsPerRow;
    const int token = first + row;
    const bool valid = token < limit && vec * 8 < head_dim;
    const __nv_bfloat16* from =
        valid ? source + (static_cast<int64_t>(token) * num_heads + head) * head_dim + vec * 8 : source;
    cp_async_16(tile + row * kStride + vec * 8, from, valid);
  }
}

// One A fragment times the B fragments of two adjacent n-tiles (b[0], b[1] and b[2], b[3], as
// the load_b_fragments_* functions return them), accumulated into c0 and c1.
__device__ __forceinline__ void mma_n_tile_pair(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                                                const uint32_t (&b)[4]) {
  mma_bf16_16x8x16(c0, a[0], a[1], a[2], a[3], b[0], b[1]);
  mma_bf16_16x8x16(c1, a[0], a[1], a[2], a[3], b[2], b[3]);
}

// C (16 x 8 * kColumnTiles per warp) += A . B_rows^T over kDimSteps k-steps of 16, operands by
// ldmatrix: A rows a_row0.. of a_tile, B rows 0.. of b_tile are the result's columns (Q K^T, dO V^T).
template <int kStride, int kDimSteps, int kColumnTiles>
__device__ __forceinline__ void ldmatrix_rows_times_rows_t(float (&c)[kColumnTiles][4], const uint16_t* a_tile,
                                                           int a_row0, const uint16_t* b_tile, int lane) {
#pragma unroll
  for (int s = 0; s < kDimSteps; ++s) {
    uint32_t a[4];
    load_a_fragment<kStride>(a, a_tile, a_row0, 16 * s, lane);
#pragma unroll
    for (int jj = 0; jj < kColumnTiles / 2; ++jj) {
      uint32_t b[4];
      load_b_fragments_from_rows<kStride>(b, b_tile, 16 * jj, 16 * s, lane);
      mma_n_tile_pair(c[2 * jj], c[2 * jj + 1], a, b);
    }
  }
}

// acc (16 x 8 * kAccTiles) += W . tile[:, 0 : 8 * kAccTiles], W given as kWeightTiles C fragments
// (rounded to bf16 A fragments), tile rows the reduction index read by ldmatrix.trans (P V, dS K).
template <int kStride, int kAccTiles, int kWeightTiles>
__device__ __forceinline__ void ldmatrix_weights_times_tile(float (&acc)[kAccTiles][4],
                                                            const float (&w)[kWeightTiles][4], const uint16_t* tile,
                                                            int lane) {
#pragma unroll
  for (int t = 0; t < kWeightTiles / 2; ++t) {
    uint32_t a[4];
    accumulators_as_a_fragment(a, w, t);
#pragma unroll
    for (int nn = 0; nn < kAccTiles / 2; ++nn) {
      uint32_t b[4];
      load_b_fragments_from_columns<kStride>(b, tile, 16 * t, 16 * nn, lane);
      mma_n_tile_pair(acc[2 * nn], acc[2 * nn + 1], a, b);
    }
  }
}

// acc (16 x 8 * kAccTiles) += A . tile[:, first_col ..], A (16 x 16 * kDimSteps) rows a_row0.. of
// the row-major shared a_tile, tile rows the reduction index (P^T dO, dS^T Q): both by ldmatrix.
template <int kAStride, int kStride, int kDimSteps, int kAccTiles>
__device__ __forceinline__ void ldmatrix_shared_times_tile(float (&acc)[kAccTiles][4], const uint16_t* a_tile,
                                                           int a_row0, const uint16_t* tile, int first_col,
                                                           int lane) {
#pragma unroll
  for (int t = 0; t < kDimSteps; ++t) {
    uint32_t a[4];
    load_a_fragment<kAStride>(a, a_tile, a_row0, 16 * t, lane);
#pragma unroll
    for (int nn = 0; nn < kAccTiles / 2; ++nn) {
      uint32_t b[4];
      load_b_fragments_from_columns<kStride>(b, tile, 16 * t, first_col + 16 * nn, lane);
      mma_n_tile_pair(acc[2 * nn], acc[2 * nn + 1], a, b);
    }
  }
}

}  // namespace deltamoe::flash_attention_detail
