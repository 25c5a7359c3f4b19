// Tensor-core building blocks of the gated delta rule kernels: warp tiles of mma.sync m16n8k16
// bf16 (sm_80 and newer) over shared-memory views, with fp32 operands split into hi + lo bf16
// parts so that products keep ~fp32 accuracy (bf16 operands are exact and are never split).
// Fragment coordinates (lane = 4 g + t): A (g | g+8, k 2t,2t+1 | 2t+8,2t+9); B (k 2t,2t+1 |
// 2t+8,2t+9, n = g); C (g | g+8, 2t | 2t+1). Each register holds two k-adjacent elements, the
// lower k in the low half.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace deltamoe::gdn_cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ uint32_t bits_of(__nv_bfloat162 x) {
  return *reinterpret_cast<const uint32_t*>(&x);
}

// (x0, x1) = hi + lo with hi the nearest bf16 pair (x - hi is exact in fp32) and lo the nearest
// bf16 pair to the rest: ~16 significant bits, an error of <= 2^-18 |x| (the lo * lo product the
// warp tile drops is of the same order).
__device__ __forceinline__ void split_bf16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  hi = bits_of(h);
  lo = bits_of(__floats2bfloat162_rn(x0 - hf.x, x1 - hf.y));
}

// A shared-memory matrix view: element (r, c) at ptr[r * kRowStride + c * kColStride]. fp32
// views are split into two bf16 parts in the products; bf16 views are exact as they are and feed
// the products through ldmatrix (their rows must start on 16 bytes: strides of 8n elements).
template <typename T, int kRowStride_, int kColStride_>
struct SmemView {
  static constexpr int kRowStride = kRowStride_, kColStride = kColStride_;
  const T* ptr;
  static constexpr bool kSplit = std::is_same_v<T, float>;
  static_assert(kSplit || ((kRowStride % 8 == 0 || kRowStride == 1) && (kColStride % 8 == 0 || kColStride == 1)),
                "bf16 views are read by ldmatrix: rows of 8n elements");
  __device__ __forceinline__ float operator()(int r, int c) const {
    return to_float(ptr[r * kRowStride + c * kColStride]);
  }
  // Elements (r, c) and (r + kDr, c + kDc) (k-adjacent: kDr + kDc == 1) as one fragment
  // register pair (hi, lo); lo is 0 for bf16 views. A pair that is adjacent in memory is read
  // with one access (the offsets used by warp_mma keep it aligned).
  template <int kDr, int kDc>
  __device__ __forceinline__ void pair(int r, int c, uint32_t& hi, uint32_t& lo) const {
    const T* at = ptr + r * kRowStride + c * kColStride;
    constexpr int kStep = kDr * kRowStride + kDc * kColStride;
    if constexpr (kSplit) {
      float x0, x1;
      if constexpr (kStep == 1) {
        const float2 x = *reinterpret_cast<const float2*>(at);
        x0 = x.x;
        x1 = x.y;
      } else {
        x0 = at[0];
        x1 = at[kStep];
      }
      split_bf16(x0, x1, hi, lo);
    } else {
      if constexpr (kStep == 1) {
        hi = *reinterpret_cast<const uint32_t*>(at);
      } else {
        const uint32_t x0 = *reinterpret_cast<const uint16_t*>(at);
        const uint32_t x1 = *reinterpret_cast<const uint16_t*>(at + kStep);
        hi = x0 | (x1 << 16);
      }
      lo = 0;
    }
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

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix: four (x4) or two (x2) 8 x 8 bf16 matrices from shared memory, lane l giving the
// address of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned); register j of lane 4 g + t holds
// row g, columns 2t and 2t + 1 of matrix j (.trans: row 2t and 2t + 1 of column g).
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_address) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(row_address));
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* row_address) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(row_address));
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(address));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(address));
}

// The A fragment (rows m.. m + 15, k.. k + 15) of a bf16 view by one ldmatrix.x4: a row-major view
// reads its rows as stored, a transposed one (k rows stored, m contiguous) transposes them. Matrix j
// of the x4 is (rows +8 (j & 1), k +8 (j >> 1)), the mma's a0..a3.
template <typename View>
__device__ __forceinline__ void load_a_fragment(const View& a, int m, int k, uint32_t (&frag)[4]) {
  const int lane = threadIdx.x & 31, row = lane & 7, matrix = lane >> 3;
  const int dm = (matrix & 1) * 8, dk = (matrix >> 1) * 8;
  if constexpr (View::kColStride == 1)  // element (m, k) at ptr[m S + k]: rows are m
    ldmatrix_x4<false>(frag, a.ptr + (m + dm + row) * View::kRowStride + k + dk);
  else  // element (m, k) at ptr[k S + m]: rows are k
    ldmatrix_x4<true>(frag, a.ptr + (k + dk + row) * View::kColStride + m + dm);
}

// The B fragments of two n-tiles (n.. n + 15, k.. k + 15) by one ldmatrix.x4: matrix j is (k +8
// (j & 1), n +8 (j >> 1)), so frag[0], frag[1] are the first tile's b0, b1 and frag[2], frag[3] the
// second's. A row-major view (k rows stored, n contiguous) transposes; a transposed view (n rows
// stored, k contiguous) reads its rows as stored.
template <typename View>
__device__ __forceinline__ void load_b_fragments(const View& b, int k, int n, uint32_t (&frag)[4]) {
  const int lane = threadIdx.x & 31, row = lane & 7, matrix = lane >> 3;
  const int dk = (matrix & 1) * 8, dn = (matrix >> 1) * 8;
  if constexpr (View::kColStride == 1)  // element (k, n) at ptr[k S + n]: rows are k
    ldmatrix_x4<true>(frag, b.ptr + (k + dk + row) * View::kRowStride + n + dn);
  else  // element (k, n) at ptr[n S + k]: rows are n
    ldmatrix_x4<false>(frag, b.ptr + (n + dn + row) * View::kColStride + k + dk);
}

// One n-tile's B fragment (n.. n + 7) by ldmatrix.x2 (lanes 16-31 give addresses too, unused).
template <typename View>
__device__ __forceinline__ void load_b_fragment(const View& b, int k, int n, uint32_t (&frag)[2]) {
  const int lane = threadIdx.x & 31, row = lane & 7, dk = ((lane >> 3) & 1) * 8;
  if constexpr (View::kColStride == 1)
    ldmatrix_x2<true>(frag, b.ptr + (k + dk + row) * View::kRowStride + n);
  else
    ldmatrix_x2<false>(frag, b.ptr + (n + row) * View::kColStride + k + dk);
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
// of 16; the views must hold zeros wherever the math has no entry (padding rows and columns).
// Split operands cost one more mma each: hi*hi + lo*hi + hi*lo (lo*lo ~2^-18 is dropped).
// Strides of split (fp32) views: a pair adjacent in memory (row-major A, transposed B) reads
// conflict-free with a row stride of 8 (mod 32) words, a pair one row apart (transposed A,
// row-major B) with 4 (mod 32). bf16 views go through ldmatrix: rows of 16 bytes times an odd
// number (mod 128 bytes) are conflict-free.
// kUnroll k-steps are unrolled: 2 by default (code size, registers); all of them (kK / 16) lets the
// fragment loads of later steps issue ahead of the mmas where registers allow.
template <int MT, int NT, int kK, int kUnroll = 2, typename ViewA, typename ViewB>
__device__ __forceinline__ void warp_mma(float (&acc)[MT][NT][4], ViewA a, int m0, ViewB b, int n0) {
  static_assert(kK % 16 == 0, "warp_mma: kK must be a multiple of 16");
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll kUnroll
  for (int k0 = 0; k0 < kK; k0 += 16) {
    uint32_t a_hi[MT][4], a_lo[MT][4], b_hi[NT][2], b_lo[NT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if constexpr (!ViewA::kSplit) {
        load_a_fragment(a, m0 + 16 * mt, k0, a_hi[mt]);
      } else {
        const int row = m0 + 16 * mt + g, k = k0 + 2 * t;
        a.template pair<0, 1>(row, k, a_hi[mt][0], a_lo[mt][0]);
        a.template pair<0, 1>(row + 8, k, a_hi[mt][1], a_lo[mt][1]);
        a.template pair<0, 1>(row, k + 8, a_hi[mt][2], a_lo[mt][2]);
        a.template pair<0, 1>(row + 8, k + 8, a_hi[mt][3], a_lo[mt][3]);
      }
    }
    if constexpr (!ViewB::kSplit) {
#pragma unroll
      for (int nt = 0; nt + 1 < NT; nt += 2) {
        uint32_t frag[4];
        load_b_fragments(b, k0, n0 + 8 * nt, frag);
        b_hi[nt][0] = frag[0], b_hi[nt][1] = frag[1], b_hi[nt + 1][0] = frag[2], b_hi[nt + 1][1] = frag[3];
      }
      if constexpr (NT % 2 == 1) load_b_fragment(b, k0, n0 + 8 * (NT - 1), b_hi[NT - 1]);
    } else {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int col = n0 + 8 * nt + g, k = k0 + 2 * t;
        b.template pair<1, 0>(k, col, b_hi[nt][0], b_lo[nt][0]);
        b.template pair<1, 0>(k + 8, col, b_hi[nt][1], b_lo[nt][1]);
      }
    }
    // Pass by pass over the tiles, so that back-to-back mmas go to different accumulators.
    if constexpr (ViewA::kSplit) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_bf16(acc[mt][nt], a_lo[mt], b_hi[nt][0], b_hi[nt][1]);
    }
    if constexpr (ViewB::kSplit) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_bf16(acc[mt][nt], a_hi[mt], b_lo[nt][0], b_lo[nt][1]);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma_bf16(acc[mt][nt], a_hi[mt], b_hi[nt][0], b_hi[nt][1]);
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

// Calls f(mt, nt, half, row, col) for every pair of adjacent accumulator elements this lane holds:
// (row, col) is entry r = 2 half, (row, col + 1) entry r = 2 half + 1; col is even.
template <int MT, int NT, typename F>
__device__ __forceinline__ void for_each_acc_pair(int m0, int n0, F&& f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) f(mt, nt, half, m0 + 16 * mt + g + 8 * half, n0 + 8 * nt + 2 * t);
}

// A warp's accumulator tile (rows m0.., columns n0..) into a bf16 shared tile of row stride
// kStride, each fragment column pair as one bf16 pair (one 4-byte store instead of two 2-byte ones).
template <int MT, int NT, int kStride>
__device__ __forceinline__ void store_acc_bf16_pairs(const float (&acc)[MT][NT][4], __nv_bfloat16* tile, int m0,
                                                     int n0) {
  for_each_acc_pair<MT, NT>(m0, n0, [&](int mt, int nt, int half, int row, int col) {
    *reinterpret_cast<__nv_bfloat162*>(&tile[row * kStride + col]) =
        __floats2bfloat162_rn(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
  });
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
