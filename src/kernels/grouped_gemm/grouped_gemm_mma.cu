// Grouped GEMM on mma.sync m16n8k16 (bf16 in, fp32 accumulate; sm_80 and sm_90): 128 x kBlockN x 32
// block tiles (kBlockN 128 or 256), 8 warps of 64 x kBlockN/4, fragments by ldmatrix (.trans for
// k-outer operands) from a 4-stage cp.async pipeline, persistent blocks walking the device-side
// tile list (group, n-tile, m-tile) and loading the next tile's first stages during the epilogue.
#include <algorithm>
#include <type_traits>

#include "core/cuda_check.h"
#include "kernels/common/kernel_path_cuda.h"
#include "kernels/grouped_gemm/grouped_gemm_cuda.h"
#include "kernels/grouped_gemm/grouped_gemm_device.cuh"
#include "kernels/grouped_gemm/grouped_gemm_kernels_cuda.h"

namespace deltamoe::grouped_gemm_detail {

namespace {

using nvbf16 = __nv_bfloat16;

constexpr int kTileM = kGroupedGemmTileRows;  // tile_starts counts tiles of this many rows
constexpr int kTileK = 32;
constexpr int kStages = 4;
constexpr int kThreads = 256;
constexpr int kWarpsN = 4;  // warps laid out 2 (m) x 4 (n)
constexpr int kWarpM = 64;
constexpr int kMmaM = kWarpM / 16;  // 16-row mma blocks per warp
// Shared tiles are padded by 8 bf16 (16 bytes) per line: the 8 line addresses of one ldmatrix
// (stride 80, 272 or 528 bytes) then fall on 8 distinct 16-byte bank groups, no conflicts.
constexpr int kPad = 8;
static_assert(kTileM == 2 * kWarpM, "two warp rows cover the tile");

// The per-width constants: warp tile 64 x kWarpN made of kMmaN mma blocks of 16 x 8.
template <int kBlockN>
struct Shape {
  static_assert(kBlockN == 128 || kBlockN == 256, "block tiles are 128 or 256 wide");
  static constexpr int kWarpN = kBlockN / kWarpsN;
  static constexpr int kMmaN = kWarpN / 8;
  // 128 wide: 126 registers, two blocks per SM overlap each other's epilogues; 256 wide: ~200
  // registers, one block per SM.
  static constexpr int kMinBlocks = kBlockN == 128 ? 2 : 1;
};

// A tile of kRows lines (m or n) stored k-major holds [kRows][kTileK + kPad]; k-outer holds
// [kTileK][kRows + kPad].
template <bool kKMajor, int kRows>
constexpr int line_stride() {
  return kKMajor ? kTileK + kPad : kRows + kPad;
}
template <bool kKMajor, int kRows>
constexpr int stage_elems() {
  return kKMajor ? kRows * line_stride<true, kRows>() : kTileK * line_stride<false, kRows>();
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes 0 writes zeros without reading (the tile's out-of-range chunks).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
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

// Issues the copies of the k-slice [k0, k0 + kTileK) of one operand tile of kRows lines:
// kRows * 4 chunks of 16 bytes, 2 or 4 per thread. The launcher guarantees that a chunk is wholly
// valid or wholly outside (the contiguous extent is a multiple of 8), except along k-outer lines,
// which are single k values.
template <bool kKMajor, int kRows>
__device__ __forceinline__ void load_stage(uint32_t smem_stage, const TileSource& src, int k0) {
  constexpr int kChunksPerLine = kKMajor ? kTileK / 8 : kRows / 8;
  constexpr int kChunks = kRows * kTileK / 8;
  static_assert(kChunks % kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int c = 0; c < kChunks / kThreads; ++c) {
    const int i = static_cast<int>(threadIdx.x) + c * kThreads;
    const int line = i / kChunksPerLine, col = (i % kChunksPerLine) * 8;
    const int row = kKMajor ? line : col;
    const int k = k0 + (kKMajor ? col : line);
    const bool valid = row < src.rows_valid && k < src.k_valid;
    const nvbf16* from = kKMajor ? src.base + row * src.ld + k : src.base + static_cast<int64_t>(k) * src.ld + row;
    const uint32_t to =
        smem_stage + static_cast<uint32_t>((line * line_stride<kKMajor, kRows>() + col) * sizeof(nvbf16));
    cp_async_16_zfill(to, valid ? from : src.base, valid ? 16 : 0);
  }
}

// Lane's ldmatrix start inside an A stage (elements), for mma row block 0 and k step 0.
// k-major: lanes 0-15 address rows 0-15 at k 0, lanes 16-31 rows 0-15 at k 8 (a0..a3 in order).
// k-outer (.trans): lanes address k lines; lane bit 3 selects rows +8, bit 4 selects k +8.
template <bool kKMajor>
__device__ __forceinline__ int a_fragment_offset(int warp_m, int lane) {
  constexpr int kStride = line_stride<kKMajor, kTileM>();
  if constexpr (kKMajor)
    return (warp_m * kWarpM + lane % 16) * kStride + (lane / 16) * 8;
  else
    return ((lane / 16) * 8 + lane % 8) * kStride + warp_m * kWarpM + ((lane / 8) % 2) * 8;
}

// Lane's ldmatrix start inside a B stage for the warp's first 16 columns, k step 0: the four 8x8
// matrices are (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15), i.e. b0, b1 of
// the first n8 block then b0, b1 of the second.
template <bool kKMajor, int kBlockN>
__device__ __forceinline__ int b_fragment_offset(int warp_n, int lane) {
  constexpr int kStride = line_stride<kKMajor, kBlockN>();
  constexpr int kWarpN = Shape<kBlockN>::kWarpN;
  if constexpr (kKMajor)
    return (warp_n * kWarpN + (lane / 16) * 8 + lane % 8) * kStride + ((lane / 8) % 2) * 8;
  else
    return (((lane / 8) % 2) * 8 + lane % 8) * kStride + warp_n * kWarpN + (lane / 16) * 8;
}

// The warp's 64 x kWarpN product over one kTileK stage.
template <bool kAKMajor, bool kBKMajor, int kBlockN>
__device__ __forceinline__ void compute_stage(float (&acc)[kMmaM][Shape<kBlockN>::kMmaN][4], uint32_t a_lane,
                                              uint32_t b_lane) {
  constexpr int kMmaN = Shape<kBlockN>::kMmaN;
  constexpr int kStrideA = line_stride<kAKMajor, kTileM>(), kStrideB = line_stride<kBKMajor, kBlockN>();
  // Next 16 rows / columns: 16 lines (k-major) or 16 elements (k-outer); next k16: the other axis.
  constexpr int kRowStepA = kAKMajor ? 16 * kStrideA : 16, kKStepA = kAKMajor ? 16 : 16 * kStrideA;
  constexpr int kColStepB = kBKMajor ? 16 * kStrideB : 16, kKStepB = kBKMajor ? 16 : 16 * kStrideB;
#pragma unroll
  for (int ks = 0; ks < kTileK / 16; ++ks) {
    uint32_t a[kMmaM][4];
    uint32_t b[kMmaN][2];
#pragma unroll
    for (int i = 0; i < kMmaM; ++i) {
      const uint32_t addr = a_lane + static_cast<uint32_t>((i * kRowStepA + ks * kKStepA) * sizeof(nvbf16));
      if constexpr (kAKMajor)
        ldmatrix_x4(a[i], addr);
      else
        ldmatrix_x4_trans(a[i], addr);
    }
#pragma unroll
    for (int jp = 0; jp < kMmaN / 2; ++jp) {
      const uint32_t addr = b_lane + static_cast<uint32_t>((jp * kColStepB + ks * kKStepB) * sizeof(nvbf16));
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

// A pair of zeros, for the positions of a tile past c's edge.
template <typename Pair>
__device__ __forceinline__ Pair zero_pair() {
  if constexpr (std::is_same_v<Pair, __nv_bfloat162>)
    return __floats2bfloat162_rn(0.0f, 0.0f);
  else
    return make_float2(0.0f, 0.0f);
}

// Accumulator element pairs straight from registers: lane (g = lane / 4, t = lane % 4) holds rows
// g and g + 8 of each 16x8 block, columns 2t and 2t + 1 (both valid or both not: n % 8 == 0).
// kAddF32 / kAddBf16 (dW, bound by reading and rewriting c) first issue the loads of a 16-row
// band, then its stores, so that loads overlap instead of each waiting for the previous store; the
// bf16 pairs stay packed (one register each) until their add.
template <int kEpilogue, int kBlockN>
__device__ __forceinline__ void store_tile(const float (&acc)[kMmaM][Shape<kBlockN>::kMmaN][4], void* c_tile,
                                           int64_t ldc, int rows_valid, int cols_valid, int warp_m, int warp_n,
                                           int lane) {
  constexpr int kMmaN = Shape<kBlockN>::kMmaN, kWarpN = Shape<kBlockN>::kWarpN;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < kMmaM; ++i) {
    // The pairs already in c (adds only): float2, or two bf16 packed in one register.
    using Pair = std::conditional_t<kEpilogue == kAddBf16, __nv_bfloat162, float2>;
    using Element = std::conditional_t<kEpilogue == kAddBf16, nvbf16, float>;
    Pair old[2][kMmaN];
    if constexpr (kEpilogue == kAddF32 || kEpilogue == kAddBf16) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp_m * kWarpM + i * 16 + g + half * 8;
#pragma unroll
        for (int j = 0; j < kMmaN; ++j) {
          const int col = warp_n * kWarpN + j * 8 + 2 * t;
          old[half][j] = row < rows_valid && col < cols_valid
                             ? *reinterpret_cast<const Pair*>(static_cast<const Element*>(c_tile) + row * ldc + col)
                             : zero_pair<Pair>();
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
        } else if constexpr (kEpilogue == kAddBf16) {
          const float2 widened = __bfloat1622float2(old[half][j]);
          *reinterpret_cast<__nv_bfloat162*>(static_cast<nvbf16*>(c_tile) + at) =
              __floats2bfloat162_rn(widened.x + v0, widened.y + v1);
        } else {
          *reinterpret_cast<float2*>(static_cast<float*>(c_tile) + at) = make_float2(v0, v1);
        }
      }
    }
  }
}

// The WMMA kernel's parameters plus the tile grid of this kernel's persistent blocks.
struct MmaParams : GroupedParams {
  int m_tiles;  // weight mode: ceil(m / 128)
  int n_tiles;  // ceil(n / kBlockN)
};

// One tile of work: its operand sources and output window; k_extent 0 means nothing to do.
struct TileWork {
  TileSource a, b;
  void* c;
  int rows_valid, cols_valid, k_extent;
};

// Rows mode: tiles are numbered group by group, n-tile major and m-tile minor inside a group, so
// blocks running together share the group's weight slices and activation rows in L2.
template <bool kBKMajor, int kEpilogue, int kBlockN>
__device__ __forceinline__ TileWork rows_tile(const MmaParams& p, int tile) {
  // Group g's tiles start at tile_starts[g] * n_tiles (each of its m-tiles for every n-tile).
  const int g = find_tile_group(p.tile_starts, p.num_groups, tile, p.n_tiles);
  const int first = p.tile_starts[g], m_tiles = p.tile_starts[g + 1] - first;
  const int local = tile - first * p.n_tiles;
  const int n_index = local / m_tiles, m_index = local - n_index * m_tiles;
  const int m0 = p.offsets[g] + m_index * kTileM, n0 = n_index * kBlockN;
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
template <int kEpilogue, int kBlockN>
__device__ __forceinline__ TileWork weight_tile(const MmaParams& p, int tile) {
  const int per_group = p.m_tiles * p.n_tiles;
  const int g = tile / per_group, local = tile - g * per_group;
  const int n_index = local / p.m_tiles, m_index = local - n_index * p.m_tiles;
  const int m0 = m_index * kTileM, n0 = n_index * kBlockN;
  const int r0 = p.offsets[g];
  TileWork w;
  w.k_extent = p.offsets[g + 1] - r0;
  w.rows_valid = p.m - m0;
  w.cols_valid = p.n - n0;
  w.a = {p.a + static_cast<int64_t>(r0) * p.m + m0, p.m, w.rows_valid, w.k_extent};
  w.b = {p.b + static_cast<int64_t>(r0) * p.n + n0, p.n, w.cols_valid, w.k_extent};
  const int64_t c_offset = static_cast<int64_t>(g) * p.m * p.n + static_cast<int64_t>(m0) * p.n + n0;
  if constexpr (kEpilogue == kAddBf16)
    w.c = static_cast<nvbf16*>(p.c) + c_offset;
  else
    w.c = static_cast<float*>(p.c) + c_offset;
  return w;
}

// The block's next tile with work, from `tile` on in steps of gridDim.x; false when none is left.
// Uniform across the block (every thread reads the same offsets).
template <bool kRowsMode, bool kBKMajor, int kEpilogue, int kBlockN>
__device__ __forceinline__ bool next_work(const MmaParams& p, int total_tiles, int& tile, TileWork& w) {
  for (; tile < total_tiles; tile += gridDim.x) {
    if constexpr (kRowsMode)
      w = rows_tile<kBKMajor, kEpilogue, kBlockN>(p, tile);
    else
      w = weight_tile<kEpilogue, kBlockN>(p, tile);
    if (w.k_extent > 0) return true;  // an empty group (weight mode) adds nothing
  }
  return false;
}

// Issues stages 0 .. kStages-2 of a tile, one commit group each (empty groups past its k-steps,
// so the main loop's wait counts stay fixed).
template <bool kAKMajor, bool kBKMajor, int kBlockN>
__device__ __forceinline__ void load_prologue(const TileWork& w, uint32_t smem_a, uint32_t smem_b) {
  constexpr int kStageA = stage_elems<kAKMajor, kTileM>(), kStageB = stage_elems<kBKMajor, kBlockN>();
  const int k_tiles = (w.k_extent + kTileK - 1) / kTileK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) {
      load_stage<kAKMajor, kTileM>(smem_a + s * kStageA * sizeof(nvbf16), w.a, s * kTileK);
      load_stage<kBKMajor, kBlockN>(smem_b + s * kStageB * sizeof(nvbf16), w.b, s * kTileK);
    }
    cp_async_commit();
  }
}

// Rows mode (kRowsMode): A [R, K] k-major, B_g [N, K] (kBKMajor) or [K, N], C [R, N].
// Weight mode: A [R, M] and B [R, N] both k-outer with K = the group's rows, C_g [M, N] f32 or
// bf16 (kAddBf16) +=.
// Persistent: block b takes tiles b, b + gridDim.x, ... up to the device-side tile count; with one
// block per SM the next tile's first stages load while this tile's accumulators are written out.
template <bool kRowsMode, bool kBKMajor, int kEpilogue, int kBlockN>
__global__ void __launch_bounds__(kThreads, Shape<kBlockN>::kMinBlocks) grouped_gemm_mma_kernel(MmaParams p) {
  constexpr bool kAKMajor = kRowsMode;
  constexpr int kMmaN = Shape<kBlockN>::kMmaN;
  constexpr int kStageA = stage_elems<kAKMajor, kTileM>(), kStageB = stage_elems<kBKMajor, kBlockN>();
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t smem_a = smem_u32(smem_raw);
  const uint32_t smem_b = smem_a + kStages * kStageA * sizeof(nvbf16);

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  const uint32_t a_lane = smem_a + a_fragment_offset<kAKMajor>(warp_m, lane) * sizeof(nvbf16);
  const uint32_t b_lane = smem_b + b_fragment_offset<kBKMajor, kBlockN>(warp_n, lane) * sizeof(nvbf16);

  const int total_tiles = kRowsMode ? p.tile_starts[p.num_groups] * p.n_tiles : p.num_groups * p.m_tiles * p.n_tiles;
  int tile = blockIdx.x;
  TileWork w;
  bool have_work = next_work<kRowsMode, kBKMajor, kEpilogue, kBlockN>(p, total_tiles, tile, w);
  if (have_work) load_prologue<kAKMajor, kBKMajor, kBlockN>(w, smem_a, smem_b);
  while (have_work) {
    float acc[kMmaM][kMmaN][4];
#pragma unroll
    for (int i = 0; i < kMmaM; ++i)
#pragma unroll
      for (int j = 0; j < kMmaN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

    const int k_tiles = (w.k_extent + kTileK - 1) / kTileK;
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      // Refill the stage computed in the previous iteration: every warp is past it now.
      const int next = kt + kStages - 1;
      if (next < k_tiles) {
        const int s = next % kStages;
        load_stage<kAKMajor, kTileM>(smem_a + s * kStageA * sizeof(nvbf16), w.a, next * kTileK);
        load_stage<kBKMajor, kBlockN>(smem_b + s * kStageB * sizeof(nvbf16), w.b, next * kTileK);
      }
      cp_async_commit();
      const int s = kt % kStages;
      compute_stage<kAKMajor, kBKMajor, kBlockN>(acc, a_lane + s * kStageA * sizeof(nvbf16),
                                                 b_lane + s * kStageB * sizeof(nvbf16));
    }
    // Only empty commit groups are pending; after the barrier no warp reads the stages any more,
    // so the next tile's prologue may overwrite them.
    cp_async_wait<0>();
    __syncthreads();
    if constexpr (Shape<kBlockN>::kMinBlocks == 1) {
      // Alone on its SM: load the next tile's first stages while this tile's results go out.
      void* const c_tile = w.c;
      const int rows_valid = w.rows_valid, cols_valid = w.cols_valid;
      tile += gridDim.x;
      have_work = next_work<kRowsMode, kBKMajor, kEpilogue, kBlockN>(p, total_tiles, tile, w);
      if (have_work) load_prologue<kAKMajor, kBKMajor, kBlockN>(w, smem_a, smem_b);
      store_tile<kEpilogue, kBlockN>(acc, c_tile, p.n, rows_valid, cols_valid, warp_m, warp_n, lane);
    } else {
      // Two blocks per SM overlap each other's epilogues; keeping the accumulators and the next
      // tile's addresses live at once would not fit in 128 registers.
      store_tile<kEpilogue, kBlockN>(acc, w.c, p.n, w.rows_valid, w.cols_valid, warp_m, warp_n, lane);
      tile += gridDim.x;
      have_work = next_work<kRowsMode, kBKMajor, kEpilogue, kBlockN>(p, total_tiles, tile, w);
      if (have_work) load_prologue<kAKMajor, kBKMajor, kBlockN>(w, smem_a, smem_b);
    }
  }
}

template <bool kRowsMode, bool kBKMajor, int kEpilogue, int kBlockN>
void launch(const MmaParams& params, int64_t max_tiles, cudaStream_t stream) {
  constexpr size_t kSmem =
      kStages * (stage_elems<kRowsMode, kTileM>() + stage_elems<kBKMajor, kBlockN>()) * sizeof(nvbf16);
  static_assert(kSmem <= kSm80MaxSharedBytesPerBlock, "the sm_80 path's kernel fits an sm_80 block");
  auto kernel = grouped_gemm_mma_kernel<kRowsMode, kBKMajor, kEpilogue, kBlockN>;
  // Above 48 KiB of dynamic shared memory needs the opt-in; both are host-side queries, no sync.
  static int blocks_per_sm = 0;
  if (blocks_per_sm == 0) {
    allow_dynamic_shared_memory(kernel, kSmem, "grouped GEMM (mma)");
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

template <int kBlockN>
void rows_mma_width(const MmaParams& base, bool b_stored_nk, DType c_dtype, int64_t max_rows, cudaStream_t stream) {
  MmaParams params = base;
  params.n_tiles = (params.n + kBlockN - 1) / kBlockN;
  // Every group wastes at most one partial tile: the device-side count is at most this.
  const int64_t max_tiles = ((max_rows + kTileM - 1) / kTileM + params.num_groups) * params.n_tiles;
  CHECK(max_tiles < (int64_t{1} << 31), "grouped GEMM (mma): ", max_tiles, " tiles overflow 32-bit tile indices");
  if (b_stored_nk) {
    if (c_dtype == DType::bf16)
      launch<true, true, kStoreBf16, kBlockN>(params, max_tiles, stream);
    else
      launch<true, true, kStoreF32, kBlockN>(params, max_tiles, stream);
  } else {
    if (c_dtype == DType::bf16)
      launch<true, false, kStoreBf16, kBlockN>(params, max_tiles, stream);
    else
      launch<true, false, kStoreF32, kBlockN>(params, max_tiles, stream);
  }
}

template <int kBlockN>
void weight_grad_mma_width(const MmaParams& base, DType c_dtype, cudaStream_t stream) {
  MmaParams params = base;
  params.m_tiles = (params.m + kTileM - 1) / kTileM;
  params.n_tiles = (params.n + kBlockN - 1) / kBlockN;
  const int64_t max_tiles = static_cast<int64_t>(params.num_groups) * params.m_tiles * params.n_tiles;
  CHECK(max_tiles < (int64_t{1} << 31), "grouped GEMM (mma): ", max_tiles, " tiles overflow 32-bit tile indices");
  if (c_dtype == DType::bf16)
    launch<false, false, kAddBf16, kBlockN>(params, max_tiles, stream);
  else
    launch<false, false, kAddF32, kBlockN>(params, max_tiles, stream);
}

}  // namespace

bool mma_applies(const void* a, const void* b, const void* c, int64_t contiguous_1, int64_t contiguous_2) {
  return contiguous_1 % 8 == 0 && contiguous_2 % 8 == 0 && aligned16(a) && aligned16(b) && aligned16(c);
}

void rows_mma(MmaTile tile, const __nv_bfloat16* a, const __nv_bfloat16* b, bool b_stored_nk, void* c, DType c_dtype,
              const int32_t* offsets, const int32_t* tile_starts, int num_groups, int64_t max_rows, int n, int k,
              cudaStream_t stream) {
  CHECK(mma_applies(a, b, c, n, k), "grouped GEMM (mma): n=", n, " and k=", k,
        " must be multiples of 8 and the operands 16-byte aligned");
  const MmaParams params{{a, b, c, offsets, tile_starts, num_groups, 0, n, k}, 0, 0};
  if (tile == MmaTile::wide)
    rows_mma_width<256>(params, b_stored_nk, c_dtype, max_rows, stream);
  else
    rows_mma_width<128>(params, b_stored_nk, c_dtype, max_rows, stream);
}

void weight_grad_mma(MmaTile tile, const __nv_bfloat16* a, const __nv_bfloat16* b, void* c, DType c_dtype,
                     const int32_t* offsets, int num_groups, int m, int n, cudaStream_t stream) {
  CHECK(mma_applies(a, b, c, m, n), "grouped GEMM (mma): m=", m, " and n=", n,
        " must be multiples of 8 and the operands 16-byte aligned");
  CHECK(c_dtype == DType::f32 || c_dtype == DType::bf16,
        "grouped GEMM dW (mma): the gradient must be f32 or bf16, got ", dtype_name(c_dtype));
  const MmaParams params{{a, b, c, offsets, nullptr, num_groups, m, n, 0}, 0, 0};
  if (tile == MmaTile::wide)
    weight_grad_mma_width<256>(params, c_dtype, stream);
  else
    weight_grad_mma_width<128>(params, c_dtype, stream);
}

}  // namespace deltamoe::grouped_gemm_detail
