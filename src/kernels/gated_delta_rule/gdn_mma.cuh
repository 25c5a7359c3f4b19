// Tensor-core building blocks of the gated delta rule kernels: warp tiles of mma.sync m16n8k8 TF32
// (sm_80 and newer) over shared-memory views, with fp32 operands split into hi + lo TF32 parts so
// that products keep ~fp32 accuracy (bf16 operands are exact in TF32 and are never split).
// Fragment coordinates (lane = 4 g + t): A (g | g+8, t | t+4); B (k = t | t+4, n = g);
// C (g | g+8, 2t | 2t+1).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace deltamoe::gdn_cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// A shared-memory matrix view: element (r, c) at ptr[r * kRowStride + c * kColStride]. fp32
// views are split into two TF32 parts in the products; bf16 views are exact as they are.
template <typename T, int kRowStride, int kColStride>
struct SmemView {
  const T* ptr;
  static constexpr bool kSplit = std::is_same_v<T, float>;
  __device__ __forceinline__ float operator()(int r, int c) const {
    return to_float(ptr[r * kRowStride + c * kColStride]);
  }
};

// Row-major view of a tile with rows of kStride elements.
template <int kStride, typename T>
__device__ __forceinline__ SmemView<T, kStride, 1> rows_of(const T* p) {
  return {p};
}
// Transposed view: element (r, c) is p[c * kStride + r].
template <int kStride, typename T>
__device__ __forceinline__ SmemView<T, 1, kStride> transposed(const T* p) {
  return {p};
}

// x rounded to TF32 (10 mantissa bits, ties away from zero) with two integer operations: adding
// half a TF32 ulp to the magnitude bits carries into the kept bits exactly when rounding up.
__device__ __forceinline__ uint32_t round_to_tf32(float x) {
  return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
}

// x = hi + lo with hi the nearest TF32 value (x - hi is exact in fp32); lo keeps the next 11
// bits (its own low bits are dropped by the tensor core, an error of ~2^-21 |x|).
template <bool kSplit>
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  if constexpr (kSplit) {
    hi = round_to_tf32(x);
    lo = __float_as_uint(x - __uint_as_float(hi));
  } else {
    hi = __float_as_uint(x);  // bf16 values: exact
    lo = 0;
  }
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int MT, int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mt][nt][r] = 0.0f;
}

// acc[MT x 16 rows][NT x 8 cols] += A[m0.., 0..kK) B[0..kK, n0..) for one warp. kK is a multiple
// of 8; the views must hold zeros wherever the math has no entry (padding rows and columns).
// Split operands cost one more mma each: hi*hi + lo*hi + hi*lo (lo*lo ~2^-22 is dropped).
template <int MT, int NT, int kK, typename ViewA, typename ViewB>
__device__ __forceinline__ void warp_mma(float (&acc)[MT][NT][4], ViewA a, int m0, ViewB b, int n0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll 2
  for (int k0 = 0; k0 < kK; k0 += 8) {
    uint32_t a_hi[MT][4], a_lo[MT][4], b_hi[NT][2], b_lo[NT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int row = m0 + 16 * mt + g;
      split_tf32<ViewA::kSplit>(a(row, k0 + t), a_hi[mt][0], a_lo[mt][0]);
      split_tf32<ViewA::kSplit>(a(row + 8, k0 + t), a_hi[mt][1], a_lo[mt][1]);
      split_tf32<ViewA::kSplit>(a(row, k0 + t + 4), a_hi[mt][2], a_lo[mt][2]);
      split_tf32<ViewA::kSplit>(a(row + 8, k0 + t + 4), a_hi[mt][3], a_lo[mt][3]);
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = n0 + 8 * nt + g;
      split_tf32<ViewB::kSplit>(b(k0 + t, col), b_hi[nt][0], b_lo[nt][0]);
      split_tf32<ViewB::kSplit>(b(k0 + t + 4, col), b_hi[nt][1], b_lo[nt][1]);
    }
    // Pass by pass over the tiles, so that back-to-back mmas go to different accumulators.
    if constexpr (ViewA::kSplit) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_tf32(acc[mt][nt], a_lo[mt], b_hi[nt][0], b_hi[nt][1]);
    }
    if constexpr (ViewB::kSplit) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_tf32(acc[mt][nt], a_hi[mt], b_lo[nt][0], b_lo[nt][1]);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma_tf32(acc[mt][nt], a_hi[mt], b_hi[nt][0], b_hi[nt][1]);
  }
}

// Calls f(mt, nt, r, row, col) for every accumulator element this lane holds.
template <int MT, int NT, typename F>
__device__ __forceinline__ void for_each_acc(int m0, int n0, F&& f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        f(mt, nt, r, m0 + 16 * mt + g + 8 * (r >> 1), n0 + 8 * nt + 2 * t + (r & 1));
}

// dst[row] += sum over this warp's columns of values (laid out like an accumulator); one shared
// atomic per row and warp. Every lane of the warp must call it.
template <int MT, int NT>
__device__ __forceinline__ void add_row_sums(const float (&values)[MT][NT][4], int m0, float* dst) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) sum += values[mt][nt][2 * half] + values[mt][nt][2 * half + 1];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (t == 0) atomicAdd(&dst[m0 + 16 * mt + g + 8 * half], sum);
    }
  }
}

// dst[col] += sum over this warp's rows of values; one shared atomic per column and warp.
template <int MT, int NT>
__device__ __forceinline__ void add_col_sums(const float (&values)[MT][NT][4], int n0, float* dst) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float sum = 0.0f;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) sum += values[mt][nt][c] + values[mt][nt][2 + c];
      sum += __shfl_xor_sync(0xffffffffu, sum, 4);
      sum += __shfl_xor_sync(0xffffffffu, sum, 8);
      sum += __shfl_xor_sync(0xffffffffu, sum, 16);
      if (g == 0) atomicAdd(&dst[n0 + 8 * nt + 2 * t + c], sum);
    }
  }
}

// The deterministic form of add_row_sums / add_col_sums, for an entry that more than two warps
// (or a nonzero start value and two warps) add to: shared atomics would add them in whatever order
// the warps arrive, and three or more fp32 terms round differently in another order. Each warp
// adds its sums into its own slice of [warps][entries] scratch (zeroed by clear_warp_slice; one
// lane per entry, so the slice needs no atomics), and add_warp_slices then adds the slices to dst
// in warp order. Calls of one slice by one warp happen in program order.
__device__ __forceinline__ void clear_warp_slice(float* slice, int entries) {
  for (int i = threadIdx.x & 31; i < entries; i += 32) slice[i] = 0.0f;
  __syncwarp();
}

template <int MT, int NT>
__device__ __forceinline__ void stage_row_sums(const float (&values)[MT][NT][4], int m0, float* slice) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) sum += values[mt][nt][2 * half] + values[mt][nt][2 * half + 1];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (t == 0) slice[m0 + 16 * mt + g + 8 * half] += sum;
    }
  }
  __syncwarp();
}

template <int MT, int NT>
__device__ __forceinline__ void stage_col_sums(const float (&values)[MT][NT][4], int n0, float* slice) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float sum = 0.0f;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) sum += values[mt][nt][c] + values[mt][nt][2 + c];
      sum += __shfl_xor_sync(0xffffffffu, sum, 4);
      sum += __shfl_xor_sync(0xffffffffu, sum, 8);
      sum += __shfl_xor_sync(0xffffffffu, sum, 16);
      if (g == 0) slice[n0 + 8 * nt + 2 * t + c] += sum;
    }
  }
  __syncwarp();
}

// dst[i] += slices[0][i] + slices[1][i] + ... in warp order, for i < entries. Every thread of the
// block must call it; barriers before (the slices are complete) and after (they may be reused).
__device__ __forceinline__ void add_warp_slices(float* dst, const float* slices, int num_warps, int entries) {
  __syncthreads();
  for (int i = threadIdx.x; i < entries; i += blockDim.x) {
    float value = dst[i];
    for (int w = 0; w < num_warps; ++w) value += slices[w * entries + i];
    dst[i] = value;
  }
  __syncthreads();
}

// 16-byte asynchronous copy global -> shared (sm_80+); zero-fills the 16 bytes when !valid
// (nothing is read then; src must still be a valid address).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  const uint32_t dst_addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_addr), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

// 4-byte asynchronous copy global -> shared; zero-fills when !valid (src must stay valid).
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
  const uint32_t dst_addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst_addr), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}

// Closes the group of cp.async copies issued so far by this thread.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most kPending committed groups of this thread are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Waits for this thread's outstanding cp.async copies; a __syncthreads after it publishes them.
__device__ __forceinline__ void wait_tile_loads() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// Block-wide copy of a rows x cols block of a row-major global matrix (row stride src_stride
// elements) into a shared tile of tile_rows x tile_cols (row stride dst_stride), zeros outside
// the block. When the global rows allow 16-byte accesses the copies are asynchronous (all in
// flight at once): call wait_tile_loads() and __syncthreads() before reading the tile. dst_stride,
// tile_cols and the shared base must keep 16-byte alignment (every tile in this folder does).
template <typename T>
__device__ __forceinline__ void load_tile(T* dst, int dst_stride, int tile_rows, int tile_cols,
                                          const T* src, int64_t src_stride, int rows, int cols) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vector_ok = cols % kVec == 0 && src_stride % kVec == 0 &&
                         (reinterpret_cast<uintptr_t>(src) & 15) == 0;
  if (vector_ok) {
    const int vecs_per_row = tile_cols / kVec;
    for (int idx = threadIdx.x; idx < tile_rows * vecs_per_row; idx += blockDim.x) {
      const int r = idx / vecs_per_row, c = (idx - r * vecs_per_row) * kVec;
      const bool valid = r < rows && c < cols;
      cp_async_16(dst + r * dst_stride + c, valid ? src + r * src_stride + c : src, valid);
    }
  } else {
    for (int idx = threadIdx.x; idx < tile_rows * tile_cols; idx += blockDim.x) {
      const int r = idx / tile_cols, c = idx - r * tile_cols;
      dst[r * dst_stride + c] = (r < rows && c < cols) ? src[r * src_stride + c] : static_cast<T>(0.0f);
    }
  }
}

}  // namespace deltamoe::gdn_cuda
