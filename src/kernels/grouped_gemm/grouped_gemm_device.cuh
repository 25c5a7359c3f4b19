// Device pieces shared by the two grouped GEMM kernels (WMMA in grouped_gemm.cu, mma.sync in
// grouped_gemm_mma.cu): the kernel parameters, operand tile sources, epilogue kinds, cp.async
// group control, and the search for the group that owns a row tile.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe::grouped_gemm_detail {

// How a kernel writes C: bf16 store, f32 store, or an add to what is there (weight gradients):
// f32, or bf16 (the stored value widened, one fp32 add, one rounding to nearest even).
enum Epilogue : int { kStoreBf16 = 0, kStoreF32 = 1, kAddF32 = 2, kAddBf16 = 3 };

struct GroupedParams {
  const __nv_bfloat16* a;
  const __nv_bfloat16* b;
  void* c;
  const int32_t* offsets;
  const int32_t* tile_starts;  // rows mode only
  int num_groups;
  int m, n, k;  // rows mode: n, k (rows come from offsets); weight mode: m, n (k from offsets)
};

// Where one operand tile comes from: logical (row, k) is base[row * ld + k] (k-major) or
// base[k * ld + row] (k-outer); rows >= rows_valid or k >= k_valid read as zero.
struct TileSource {
  const __nv_bfloat16* base;
  int64_t ld;
  int rows_valid;
  int k_valid;
};

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// The group of row tile `tile` when group g's tiles start at tile_starts[g] * tiles_per_start:
// the last g with that start <= tile, which skips empty groups (their start equals the next one's).
__device__ __forceinline__ int find_tile_group(const int32_t* tile_starts, int num_groups, int tile,
                                               int tiles_per_start) {
  int lo = 0, hi = num_groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_starts[mid] * tiles_per_start <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

}  // namespace deltamoe::grouped_gemm_detail
