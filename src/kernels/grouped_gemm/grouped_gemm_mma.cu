// Grouped GEMM on mma.sync m16n8k16 (bf16 in, fp32 accumulate; sm_80 and sm_90): 128x128x32 block
// tiles, 8 warps of 64x32, fragments by ldmatrix (.trans for k-outer operands) from a 4-stage
// cp.async pipeline, persistent blocks walking the device-side tile list (group, n-tile, m-tile).
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/grouped_gemm/grouped_gemm_cuda.h"
#include "kernels/grouped_gemm/grouped_gemm_kernels_cuda.h"

namespace deltamoe::grouped_gemm_detail {

namespace {

using nvbf16 = __nv_bfloat16;

constexpr int kTileM = kGroupedGemmTileRows;  // tile_starts counts tiles of this many rows
constexpr int kTileN = 128;
constexpr int kTileK = 32;
constexpr int kStages = 4;
constexpr int kThreads = 256;
constexpr int kWarpsN = 4;  // warps laid out 2 (m) x 4 (n), each owning 64 x 32 of the tile
constexpr int kWarpM = 64, kWarpN = 32;
constexpr int kMmaM = kWarpM / 16, kMmaN = kWarpN / 8;  // 4 x 4 mma tiles of 16x8 per warp
// Shared tiles are padded by 8 bf16 (16 bytes) per line: the 8 line addresses of one ldmatrix
// (stride 80 or 272 bytes) then fall on 8 distinct 16-byte bank groups, no conflicts.
constexpr int kPad = 8;
static_assert(kTileM == kTileN, "one loader serves both operands: 128 lines of m or n");

enum Epilogue : int { kStoreBf16 = 0, kStoreF32 = 1, kAddF32 = 2 };

// A tile stored k-major holds [128 rows][kTileK + kPad]; k-outer holds [kTileK][128 + kPad].
template <bool kKMajor>
constexpr int line_stride() {
  return kKMajor ? kTileK + kPad : kTileM + kPad;
}
template <bool kKMajor>
constexpr int stage_elems() {
  return kKMajor ? kTileM * line_stride<true>() : kTileK * line_stride<false>();
}

// Where one operand tile comes from: logical (row, k) is base[row * ld + k] (k-major) or
// base[k * ld + row] (k-outer); rows >= rows_valid or k >= k_valid read as zero.
struct TileSource {
  const nvbf16* base;
  int64_t ld;
  int rows_valid;
  int k_valid;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes 0 writes zeros without reading (the tile's out-of-range chunks).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void mma_16x8x16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Issues the copies of the k-slice [k0, k0 + kTileK) of one operand tile: 512 chunks of 16 bytes,
// two per thread. The launcher guarantees that a chunk is wholly valid or wholly outside (the
// contiguous extent is a multiple of 8), except along k-outer lines, which are single k values.
template <bool kKMajor>
__device__ __forceinline__ void load_stage(uint32_t smem_stage, const TileSource& src, int k0) {
  constexpr int kChunksPerLine = kKMajor ? kTileK / 8 : kTileM / 8;
  constexpr int kChunks = kTileM * kTileK / 8;
  static_assert(kChunks % kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int c = 0; c < kChunks / kThreads; ++c) {
    const int i = static_cast<int>(threadIdx.x) + c * kThreads;
    const int line = i / kChunksPerLine, col = (i % kChunksPerLine) * 8;
    const int row = kKMajor ? line : col;
    const int k = k0 + (kKMajor ? col : line);
    const bool valid = row < src.rows_valid && k < src.k_valid;
    const nvbf16* from = kKMajor ? src.base + row * src.ld + k : src.base + static_cast<int64_t>(k) * src.ld + row;
    const uint32_t to = smem_stage + static_cast<uint32_t>((line * line_stride<kKMajor>() + col) * sizeof(nvbf16));
    cp_async_16_zfill(to, valid ? from : src.base, valid ? 16 : 0);
  }
}

// Lane's ldmatrix start inside an A stage (elements), for mma row block 0 and k step 0.
// k-major: lanes 0-15 address rows 0-15 at k 0, lanes 16-31 rows 0-15 at k 8 (a0..a3 in order).
// k-outer (.trans): lanes address k lines; lane bit 3 selects rows +8, bit 4 selects k +8.
template <bool kKMajor>
__device__ __forceinline__ int a_fragment_offset(int warp_m, int lane) {
  if constexpr (kKMajor)
    return (warp_m * kWarpM + lane % 16) * line_stride<true>() + (lane / 16) * 8;
  else
    return ((lane / 16) * 8 + lane % 8) * line_stride<false>() + warp_m * kWarpM + ((lane / 8) % 2) * 8;
}

// Lane's ldmatrix start inside a B stage for n columns [16 jp, 16 jp + 16) of the warp, k step 0:
// the four 8x8 matrices are (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15),
// i.e. b0, b1 of the first n8 block then b0, b1 of the second.
template <bool kKMajor>
__device__ __forceinline__ int b_fragment_offset(int warp_n, int lane) {
  if constexpr (kKMajor)
    return (warp_n * kWarpN + (lane / 16) * 8 + lane % 8) * line_stride<true>() + ((lane / 8) % 2) * 8;
  else
    return (((lane / 8) % 2) * 8 + lane % 8) * line_stride<false>() + warp_n * kWarpN + (lane / 16) * 8;
}

// The warp's 64x32 product over one kTileK stage.
template <bool kAKMajor, bool kBKMajor>
__device__ __forceinline__ void compute_stage(float (&acc)[kMmaM][kMmaN][4], uint32_t a_lane, uint32_t b_lane) {
#pragma unroll
  for (int kk = 0; kk < kTileK; kk += 16) {
    uint32_t a[kMmaM][4];
    uint32_t b[kMmaN][2];
#pragma unroll
    for (int i = 0; i < kMmaM; ++i) {
      // Row block i: +16 rows (k-major: 16 lines; k-outer: 16 elements); k step: the other axis.
      constexpr int kRowStep = kAKMajor ? 16 * line_stride<true>() : 16;
      const int k_step = kAKMajor ? kk : kk * line_stride<false>();
      const uint32_t addr = a_lane + static_cast<uint32_t>((i * kRowStep + k_step) * sizeof(nvbf16));
      if constexpr (kAKMajor)
        ldmatrix_x4(a[i], addr);
      else
        ldmatrix_x4_trans(a[i], addr);
    }
#pragma unroll
    for (int jp = 0; jp < kMmaN / 2; ++jp) {
      constexpr int kColStep = kBKMajor ? 16 * line_stride<true>() : 16;
      const int k_step = kBKMajor ? kk : kk * line_stride<false>();
      const uint32_t addr = b_lane + static_cast<uint32_t>((jp * kColStep + k_step) * sizeof(nvbf16));
      uint32_t r[4];
      if constexpr (kBKMajor)
        ldmatrix_x4(r, addr);
      else
        ldmatrix_x4_trans(r, addr);
      b[2 * jp][0] = r[0];
      b[2 * jp][1] = r[1];
      b[2 * jp + 1][0] = r[2];
      b[2 * jp + 1][1] = r[3];
    }
#pragma unroll
    for (int i = 0; i < kMmaM; ++i)
#pragma unroll
      for (int j = 0; j < kMmaN; ++j) mma_16x8x16(acc[i][j], a[i], b[j][0], b[j][1]);
  }
}

// Accumulator element pairs straight from registers: lane (g = lane / 4, t = lane % 4) holds rows
// g and g + 8 of each 16x8 block, columns 2t and 2t + 1 (both valid or both not: n % 8 == 0).
// kAddF32 (dW, bound by reading and rewriting c) first issues the 8 loads of a 16-row band, then
// the 8 stores, so that loads overlap instead of each waiting for the previous store.
template <int kEpilogue>
__device__ __forceinline__ void store_tile(const float (&acc)[kMmaM][kMmaN][4], void* c_tile, int64_t ldc,
                                           int rows_valid, int cols_valid, int warp_m, int warp_n, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < kMmaM; ++i) {
    float2 old[2][kMmaN];
    if constexpr (kEpilogue == kAddF32) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp_m * kWarpM + i * 16 + g + half * 8;
#pragma unroll
        for (int j = 0; j < kMmaN; ++j) {
          const int col = warp_n * kWarpN + j * 8 + 2 * t;
          old[half][j] = row < rows_valid && col < cols_valid
                             ? *reinterpret_cast<const float2*>(static_cast<const float*>(c_tile) + row * ldc + col)
                             : make_float2(0.0f, 0.0f);
        }
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_m * kWarpM + i * 16 + g + half * 8;
      if (row >= rows_valid) continue;
#pragma unroll
      for (int j = 0; j < kMmaN; ++j) {
        const int col = warp_n * kWarpN + j * 8 + 2 * t;
        if (col >= cols_valid) continue;
        const float v0 = acc[i][j][2 * half], v1 = acc[i][j][2 * half + 1];
        const int64_t at = row * ldc + col;
        if constexpr (kEpilogue == kStoreBf16) {
          *reinterpret_cast<__nv_bfloat162*>(static_cast<nvbf16*>(c_tile) + at) = __floats2bfloat162_rn(v0, v1);
        } else if constexpr (kEpilogue == kAddF32) {
          *reinterpret_cast<float2*>(static_cast<float*>(c_tile) + at) =
              make_float2(old[half][j].x + v0, old[half][j].y + v1);
        } else {
          *reinterpret_cast<float2*>(static_cast<float*>(c_tile) + at) = make_float2(v0, v1);
        }
      }
    }
  }
}

struct MmaParams {
  const nvbf16* a;
  const nvbf16* b;
  void* c;
  const int32_t* offsets;
  const int32_t* tile_starts;  // rows mode only
  int num_groups;
  int m, n, k;  // rows mode: n, k (rows from offsets); weight mode: m, n (k from offsets)
  int m_tiles;  // weight mode: ceil(m / 128)
  int n_tiles;  // ceil(n / 128)
};

// One tile of work: its operand sources and output window; k_extent 0 means nothing to do.
struct TileWork {
  TileSource a, b;
  void* c;
  int rows_valid, cols_valid, k_extent;
};

// Rows mode: tiles are numbered group by group, n-tile major and m-tile minor inside a group, so
// blocks running together share the group's weight slices and activation rows in L2.
template <bool kBKMajor, int kEpilogue>
__device__ __forceinline__ TileWork rows_tile(const MmaParams& p, int tile) {
  // The group of this tile: the last g with tile_starts[g] * n_tiles <= tile (skips empty groups).
  int lo = 0, hi = p.num_groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.tile_starts[mid] * p.n_tiles <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int g = lo;
  const int first = p.tile_starts[g], m_tiles = p.tile_starts[g + 1] - first;
  const int local = tile - first * p.n_tiles;
  const int n_index = local / m_tiles, m_index = local - n_index * m_tiles;
  const int m0 = p.offsets[g] + m_index * kTileM, n0 = n_index * kTileN;
  TileWork w;
  w.rows_valid = p.offsets[g + 1] - m0;
  w.cols_valid = p.n - n0;
  w.k_extent = p.k;
  w.a = {p.a + static_cast<int64_t>(m0) * p.k, p.k, w.rows_valid, p.k};
  const nvbf16* b_g = p.b + static_cast<int64_t>(g) * p.n * p.k;
  w.b = kBKMajor ? TileSource{b_g + static_cast<int64_t>(n0) * p.k, p.k, w.cols_valid, p.k}
                 : TileSource{b_g + n0, p.n, w.cols_valid, p.k};
  const int64_t c_offset = static_cast<int64_t>(m0) * p.n + n0;
  if constexpr (kEpilogue == kStoreBf16)
    w.c = static_cast<nvbf16*>(p.c) + c_offset;
  else
    w.c = static_cast<float*>(p.c) + c_offset;
  return w;
}

// Weight mode: tile = (group, n-tile, m-tile); K is the group's rows (possibly 0: nothing to add).
__device__ __forceinline__ TileWork weight_tile(const MmaParams& p, int tile) {
  const int per_group = p.m_tiles * p.n_tiles;
  const int g = tile / per_group, local = tile - g * per_group;
  const int n_index = local / p.m_tiles, m_index = local - n_index * p.m_tiles;
  const int m0 = m_index * kTileM, n0 = n_index * kTileN;
  const int r0 = p.offsets[g];
  TileWork w;
  w.k_extent = p.offsets[g + 1] - r0;
  w.rows_valid = p.m - m0;
  w.cols_valid = p.n - n0;
  w.a = {p.a + static_cast<int64_t>(r0) * p.m + m0, p.m, w.rows_valid, w.k_extent};
  w.b = {p.b + static_cast<int64_t>(r0) * p.n + n0, p.n, w.cols_valid, w.k_extent};
  w.c = static_cast<float*>(p.c) + static_cast<int64_t>(g) * p.m * p.n + static_cast<int64_t>(m0) * p.n + n0;
  return w;
}

// Rows mode (kRowsMode): A [R, K] k-major, B_g [N, K] (kBKMajor) or [K, N], C [R, N].
// Weight mode: A [R, M] and B [R, N] both k-outer with K = the group's rows, C_g [M, N] f32 +=.
// Persistent: block b takes tiles b, b + gridDim.x, ... up to the device-side tile count.
template <bool kRowsMode, bool kBKMajor, int kEpilogue>
__global__ void __launch_bounds__(kThreads, 2) grouped_gemm_mma_kernel(MmaParams p) {
  constexpr bool kAKMajor = kRowsMode;
  constexpr int kStageA = stage_elems<kAKMajor>(), kStageB = stage_elems<kBKMajor>();
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t smem_a = smem_u32(smem_raw);
  const uint32_t smem_b = smem_a + kStages * kStageA * sizeof(nvbf16);

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  const uint32_t a_lane = smem_a + a_fragment_offset<kAKMajor>(warp_m, lane) * sizeof(nvbf16);
  const uint32_t b_lane = smem_b + b_fragment_offset<kBKMajor>(warp_n, lane) * sizeof(nvbf16);

  const int total_tiles = kRowsMode ? p.tile_starts[p.num_groups] * p.n_tiles : p.num_groups * p.m_tiles * p.n_tiles;
  for (int tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    TileWork w;
    if constexpr (kRowsMode)
      w = rows_tile<kBKMajor, kEpilogue>(p, tile);
    else
      w = weight_tile(p, tile);
    if (w.k_extent <= 0) continue;  // whole block: an empty group adds nothing

    float acc[kMmaM][kMmaN][4];
#pragma unroll
    for (int i = 0; i < kMmaM; ++i)
#pragma unroll
      for (int j = 0; j < kMmaN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

    const int k_tiles = (w.k_extent + kTileK - 1) / kTileK;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) {
        load_stage<kAKMajor>(smem_a + s * kStageA * sizeof(nvbf16), w.a, s * kTileK);
        load_stage<kBKMajor>(smem_b + s * kStageB * sizeof(nvbf16), w.b, s * kTileK);
      }
      cp_async_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      // Refill the stage computed in the previous iteration: every warp is past it now.
      const int next = kt + kStages - 1;
      if (next < k_tiles) {
        const int s = next % kStages;
        load_stage<kAKMajor>(smem_a + s * kStageA * sizeof(nvbf16), w.a, next * kTileK);
        load_stage<kBKMajor>(smem_b + s * kStageB * sizeof(nvbf16), w.b, next * kTileK);
      }
      cp_async_commit();
      const int s = kt % kStages;
      compute_stage<kAKMajor, kBKMajor>(acc, a_lane + s * kStageA * sizeof(nvbf16),
                                        b_lane + s * kStageB * sizeof(nvbf16));
    }
    cp_async_wait<0>();
    store_tile<kEpilogue>(acc, w.c, p.n, w.rows_valid, w.cols_valid, warp_m, warp_n, lane);
    // The next tile's prologue overwrites stages that slower warps may still be reading.
    __syncthreads();
  }
}

template <bool kRowsMode, bool kBKMajor, int kEpilogue>
void launch(const MmaParams& params, int64_t max_tiles, cudaStream_t stream) {
  constexpr size_t kSmem = kStages * (stage_elems<kRowsMode>() + stage_elems<kBKMajor>()) * sizeof(nvbf16);
  auto kernel = grouped_gemm_mma_kernel<kRowsMode, kBKMajor, kEpilogue>;
  // Above 48 KiB of dynamic shared memory needs the opt-in; both are host-side queries, no sync.
  static int blocks_per_sm = 0;
  if (blocks_per_sm == 0) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem)));
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kThreads, kSmem));
    CHECK(blocks_per_sm >= 1, "grouped GEMM (mma): the kernel does not fit on this device (", kSmem,
          " bytes of shared memory per block)");
  }
  int device = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t resident = static_cast<int64_t>(sms) * blocks_per_sm;
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min(max_tiles, resident)));
  kernel<<<grid, kThreads, kSmem, stream>>>(params);
  CUDA_CHECK_LAUNCH();
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool mma_applies(const void* a, const void* b, const void* c, int64_t contiguous_1, int64_t contiguous_2) {
  return contiguous_1 % 8 == 0 && contiguous_2 % 8 == 0 && aligned16(a) && aligned16(b) && aligned16(c);
}

void rows_mma(const __nv_bfloat16* a, const __nv_bfloat16* b, bool b_stored_nk, void* c, DType c_dtype,
              const int32_t* offsets, const int32_t* tile_starts, int num_groups, int64_t max_rows, int n, int k,
              cudaStream_t stream) {
  CHECK(mma_applies(a, b, c, n, k), "grouped GEMM (mma): n=", n, " and k=", k,
        " must be multiples of 8 and the operands 16-byte aligned");
  const int n_tiles = (n + kTileN - 1) / kTileN;
  const MmaParams params{a, b, c, offsets, tile_starts, num_groups, 0, n, k, 0, n_tiles};
  // Every group wastes at most one partial tile: the device-side count is at most this.
  const int64_t max_tiles = ((max_rows + kTileM - 1) / kTileM + num_groups) * n_tiles;
  CHECK(max_tiles < (int64_t{1} << 31), "grouped GEMM (mma): ", max_tiles, " tiles overflow 32-bit tile indices");
  if (b_stored_nk) {
    if (c_dtype == DType::bf16)
      launch<true, true, kStoreBf16>(params, max_tiles, stream);
    else
      launch<true, true, kStoreF32>(params, max_tiles, stream);
  } else {
    if (c_dtype == DType::bf16)
      launch<true, false, kStoreBf16>(params, max_tiles, stream);
    else
      launch<true, false, kStoreF32>(params, max_tiles, stream);
  }
}

void weight_grad_mma(const __nv_bfloat16* a, const __nv_bfloat16* b, float* c, const int32_t* offsets, int num_groups,
                     int m, int n, cudaStream_t stream) {
  CHECK(mma_applies(a, b, c, m, n), "grouped GEMM (mma): m=", m, " and n=", n,
        " must be multiples of 8 and the operands 16-byte aligned");
  const int m_tiles = (m + kTileM - 1) / kTileM, n_tiles = (n + kTileN - 1) / kTileN;
  const int64_t max_tiles = static_cast<int64_t>(num_groups) * m_tiles * n_tiles;
  CHECK(max_tiles < (int64_t{1} << 31), "grouped GEMM (mma): ", max_tiles, " tiles overflow 32-bit tile indices");
  const MmaParams params{a, b, c, offsets, nullptr, num_groups, m, n, 0, m_tiles, n_tiles};
  launch<false, false, kAddF32>(params, max_tiles, stream);
}

}  // namespace deltamoe::grouped_gemm_detail
