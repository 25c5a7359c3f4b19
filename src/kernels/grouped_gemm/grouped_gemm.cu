// Grouped GEMM launchers (validation, kernel choice) and the any-shape WMMA kernel: 128x128x32 block
// tiles, 8 warps of 64x32 WMMA (nvbf16, fp32 accumulate), a 3-stage cp.async pipeline, group sizes
// read on the device (launch over an upper bound). It takes the products the mma.sync kernel
// (grouped_gemm_mma.cu, every aligned product with extents in multiples of 8) cannot.
#include <mma.h>

#include <algorithm>
#include <type_traits>

#include "core/cuda_check.h"
#include "kernels/common/kernel_path_cuda.h"
#include "kernels/grouped_gemm/grouped_gemm_cuda.h"
#include "kernels/grouped_gemm/grouped_gemm_device.cuh"
#include "kernels/grouped_gemm/grouped_gemm_kernels_cuda.h"

namespace deltamoe {

// Block tiles of the mma.sync kernel that callers get: the row-grouped products (forward, dX) and
// the weight gradients (bound by the f32 read-modify-write of c; two blocks per SM overlap it).
constexpr grouped_gemm_detail::MmaTile kRowsMmaTile = grouped_gemm_detail::MmaTile::wide;
constexpr grouped_gemm_detail::MmaTile kWeightGradMmaTile = grouped_gemm_detail::MmaTile::square;

namespace {

namespace wmma = nvcuda::wmma;
using nvbf16 = __nv_bfloat16;

constexpr int kTileM = kGroupedGemmTileRows;
constexpr int kTileN = 128;
constexpr int kTileK = 32;
constexpr int kStages = 3;
constexpr int kThreads = 256;
constexpr int kPad = 8;  // nvbf16 elements of row padding: breaks bank conflicts, keeps 16-byte rows
constexpr int kWarpM = 64, kWarpN = 32;
constexpr int kFragsM = kWarpM / 16, kFragsN = kWarpN / 16;

using grouped_gemm_detail::aligned16;
using grouped_gemm_detail::cp_async_commit;
using grouped_gemm_detail::cp_async_wait;
using grouped_gemm_detail::GroupedParams;
using grouped_gemm_detail::kAddBf16;
using grouped_gemm_detail::kAddF32;
using grouped_gemm_detail::kStoreBf16;
using grouped_gemm_detail::kStoreF32;
using grouped_gemm_detail::TileSource;

// Elements of one stage of a tile held k-major ([rows][K]) or k-outer ([K][rows]).
template <bool kKMajor, int kRows>
constexpr int stage_elems() {
  return kKMajor ? kRows * (kTileK + kPad) : kTileK * (kRows + kPad);
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* global) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global));
}

// Copies the k-slice [k0, k0 + kTileK) of a tile into shared memory. Aligned: 16-byte cp.async
// chunks (the launcher guarantees that the contiguous extent is a multiple of 8 and the base
// 16-byte aligned, so a chunk is wholly inside or wholly outside). Otherwise element by element.
template <bool kKMajor, int kRows, bool kAligned>
__device__ __forceinline__ void load_tile(nvbf16* smem, const TileSource& t, int k0) {
  const int tid = threadIdx.x;
  if constexpr (kAligned) {
    constexpr int kChunksPerLine = kKMajor ? kTileK / 8 : kRows / 8;
    constexpr int kChunks = kRows * kTileK / 8;
#pragma unroll
    for (int i = tid; i < kChunks; i += kThreads) {
      const int line = i / kChunksPerLine, col = (i % kChunksPerLine) * 8;
      int row, k;
      nvbf16* dst;
      if constexpr (kKMajor) {
        row = line, k = k0 + col;
        dst = smem + line * (kTileK + kPad) + col;
      } else {
        row = col, k = k0 + line;
        dst = smem + line * (kRows + kPad) + col;
      }
      if (row < t.rows_valid && k < t.k_valid) {
        const nvbf16* src = kKMajor ? t.base + row * t.ld + k : t.base + static_cast<int64_t>(k) * t.ld + row;
        cp_async_16(dst, src);
      } else {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      }
    }
  } else {
    for (int i = tid; i < kRows * kTileK; i += kThreads) {
      int row, kk;
      nvbf16* dst;
      if constexpr (kKMajor) {
        row = i / kTileK, kk = i % kTileK;
        dst = smem + row * (kTileK + kPad) + kk;
      } else {
        kk = i / kRows, row = i % kRows;
        dst = smem + kk * (kRows + kPad) + row;
      }
      const int k = k0 + kk;
      nvbf16 value = __float2bfloat16(0.0f);
      if (row < t.rows_valid && k < t.k_valid)
        value = kKMajor ? t.base[row * t.ld + k] : t.base[static_cast<int64_t>(k) * t.ld + row];
      *dst = value;
    }
  }
}

// Eight floats rounded to bf16 in one 16-byte word (kept in registers, no local array).
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&pair);
}
__device__ __forceinline__ uint4 pack_bf16x8(const float* v) {
  return make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7]));
}
// Two bf16 of a 32-bit word (the lower address in the low half) widened, each plus its float, rounded.
__device__ __forceinline__ unsigned add_bf16x2(unsigned old, float lo, float hi) {
  const float2 widened = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&old));
  return pack_bf16x2(widened.x + lo, widened.y + hi);
}

// Rows mode (kRowsMode): A [R, K] k-major, B_g [N, K] (kBKMajor) or [K, N], C [R, N].
// Weight mode: A [R, M] and B [R, N] both k-outer with K = the group's rows, C_g [M, N] f32 or
// bf16 (kAddBf16) +=.
template <bool kRowsMode, bool kBKMajor, bool kAligned, int kEpilogue>
__global__ void __launch_bounds__(kThreads) grouped_gemm_kernel(GroupedParams p) {
  constexpr bool kAKMajor = kRowsMode;
  constexpr int kStageA = stage_elems<kAKMajor, kTileM>();
  constexpr int kStageB = stage_elems<kBKMajor, kTileN>();
  extern __shared__ __align__(128) unsigned char smem_raw[];
  nvbf16* smem_a = reinterpret_cast<nvbf16*>(smem_raw);
  nvbf16* smem_b = smem_a + kStages * kStageA;
  float* scratch = reinterpret_cast<float*>(smem_b + kStages * kStageB);  // 16x16 floats per warp

  TileSource ta, tb;
  float* c_f32 = nullptr;
  nvbf16* c_bf16 = nullptr;
  int64_t ldc;
  int rows_valid, cols_valid, k_extent;
  const int n0 = blockIdx.y * kTileN;
  if constexpr (kRowsMode) {
    const int tile = blockIdx.x;
    if (tile >= p.tile_starts[p.num_groups]) return;
    const int g = grouped_gemm_detail::find_tile_group(p.tile_starts, p.num_groups, tile, 1);
    const int m0 = p.offsets[g] + (tile - p.tile_starts[g]) * kTileM;
    rows_valid = p.offsets[g + 1] - m0;
    cols_valid = p.n - n0;
    k_extent = p.k;
    ta = {p.a + static_cast<int64_t>(m0) * p.k, p.k, rows_valid, p.k};
    const nvbf16* b_g = p.b + static_cast<int64_t>(g) * p.n * p.k;
    tb = kBKMajor ? TileSource{b_g + static_cast<int64_t>(n0) * p.k, p.k, cols_valid, p.k}
                  : TileSource{b_g + n0, p.n, cols_valid, p.k};
    ldc = p.n;
    const int64_t c_offset = static_cast<int64_t>(m0) * p.n + n0;
    if constexpr (kEpilogue == kStoreBf16)
      c_bf16 = static_cast<nvbf16*>(p.c) + c_offset;
    else
      c_f32 = static_cast<float*>(p.c) + c_offset;
  } else {
    const int g = blockIdx.z;
    const int r0 = p.offsets[g];
    k_extent = p.offsets[g + 1] - r0;
    if (k_extent <= 0) return;
    const int m0 = blockIdx.x * kTileM;
    rows_valid = p.m - m0;
    cols_valid = p.n - n0;
    ta = {p.a + static_cast<int64_t>(r0) * p.m + m0, p.m, rows_valid, k_extent};
    tb = {p.b + static_cast<int64_t>(r0) * p.n + n0, p.n, cols_valid, k_extent};
    ldc = p.n;
    const int64_t c_offset = static_cast<int64_t>(g) * p.m * p.n + static_cast<int64_t>(m0) * p.n + n0;
    if constexpr (kEpilogue == kAddBf16)
      c_bf16 = static_cast<nvbf16*>(p.c) + c_offset;
    else
      c_f32 = static_cast<float*>(p.c) + c_offset;
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / (kTileN / kWarpN), warp_n = warp % (kTileN / kWarpN);

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kFragsM][kFragsN];
#pragma unroll
  for (int i = 0; i < kFragsM; ++i)
#pragma unroll
    for (int j = 0; j < kFragsN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  const int k_tiles = (k_extent + kTileK - 1) / kTileK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) {
      load_tile<kAKMajor, kTileM, kAligned>(smem_a + s * kStageA, ta, s * kTileK);
      load_tile<kBKMajor, kTileN, kAligned>(smem_b + s * kStageB, tb, s * kTileK);
    }
    cp_async_commit();
  }

  using ALayout = std::conditional_t<kAKMajor, wmma::row_major, wmma::col_major>;
  using BLayout = std::conditional_t<kBKMajor, wmma::col_major, wmma::row_major>;
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    // Refill the stage computed in the previous iteration (everybody is past it now).
    const int next = kt + kStages - 1;
    if (next < k_tiles) {
      load_tile<kAKMajor, kTileM, kAligned>(smem_a + (next % kStages) * kStageA, ta, next * kTileK);
      load_tile<kBKMajor, kTileN, kAligned>(smem_b + (next % kStages) * kStageB, tb, next * kTileK);
    }
    cp_async_commit();

    const nvbf16* sa = smem_a + (kt % kStages) * kStageA;
    const nvbf16* sb = smem_b + (kt % kStages) * kStageB;
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, nvbf16, ALayout> fa[kFragsM];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, nvbf16, BLayout> fb[kFragsN];
#pragma unroll
      for (int i = 0; i < kFragsM; ++i) {
        const int row = warp_m * kWarpM + i * 16;
        if constexpr (kAKMajor)
          wmma::load_matrix_sync(fa[i], sa + row * (kTileK + kPad) + kk, kTileK + kPad);
        else
          wmma::load_matrix_sync(fa[i], sa + kk * (kTileM + kPad) + row, kTileM + kPad);
      }
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) {
        const int col = warp_n * kWarpN + j * 16;
        if constexpr (kBKMajor)
          wmma::load_matrix_sync(fb[j], sb + col * (kTileK + kPad) + kk, kTileK + kPad);
        else
          wmma::load_matrix_sync(fb[j], sb + kk * (kTileN + kPad) + col, kTileN + kPad);
      }
#pragma unroll
      for (int i = 0; i < kFragsM; ++i)
#pragma unroll
        for (int j = 0; j < kFragsN; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
  }
  cp_async_wait<0>();

  // Epilogue through a per-warp 16x16 scratch: lane handles row lane/2, 8 columns.
  float* my_scratch = scratch + warp * 256;
  const int sub_row = lane / 2, sub_col = (lane % 2) * 8;
#pragma unroll
  for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
    for (int j = 0; j < kFragsN; ++j) {
      wmma::store_matrix_sync(my_scratch, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      const int row = warp_m * kWarpM + i * 16 + sub_row;
      const int col = warp_n * kWarpN + j * 16 + sub_col;
      if (row < rows_valid) {
        const float* v = my_scratch + sub_row * 16 + sub_col;
        const int64_t at = row * ldc + col;
        if (kAligned && col + 8 <= cols_valid) {
          if constexpr (kEpilogue == kStoreBf16) {
            *reinterpret_cast<uint4*>(c_bf16 + at) = pack_bf16x8(v);
          } else if constexpr (kEpilogue == kAddBf16) {
            uint4* dst = reinterpret_cast<uint4*>(c_bf16 + at);
            const uint4 old = *dst;
            *dst = make_uint4(add_bf16x2(old.x, v[0], v[1]), add_bf16x2(old.y, v[2], v[3]),
                              add_bf16x2(old.z, v[4], v[5]), add_bf16x2(old.w, v[6], v[7]));
          } else {
            float4* dst = reinterpret_cast<float4*>(c_f32 + at);
            float4 lo = make_float4(v[0], v[1], v[2], v[3]), hi = make_float4(v[4], v[5], v[6], v[7]);
            if constexpr (kEpilogue == kAddF32) {
              const float4 old_lo = dst[0], old_hi = dst[1];
              lo = make_float4(lo.x + old_lo.x, lo.y + old_lo.y, lo.z + old_lo.z, lo.w + old_lo.w);
              hi = make_float4(hi.x + old_hi.x, hi.y + old_hi.y, hi.z + old_hi.z, hi.w + old_hi.w);
            }
            dst[0] = lo;
            dst[1] = hi;
          }
        } else {
          for (int e = 0; e < 8 && col + e < cols_valid; ++e) {
            if constexpr (kEpilogue == kStoreBf16)
              c_bf16[at + e] = __float2bfloat16(v[e]);
            else if constexpr (kEpilogue == kAddBf16)
              c_bf16[at + e] = __float2bfloat16_rn(__bfloat162float(c_bf16[at + e]) + v[e]);
            else if constexpr (kEpilogue == kStoreF32)
              c_f32[at + e] = v[e];
            else
              c_f32[at + e] += v[e];
          }
        }
      }
      __syncwarp();
    }
  }
}

// tile_starts[g] = sum over groups before g of ceil(rows_g / kTileM); tile_starts[G] = total.
__global__ void build_tile_starts_kernel(const int32_t* offsets, int num_groups, int32_t* tile_starts) {
  const int lane = threadIdx.x;
  int carry = 0;
  for (int base = 0; base < num_groups; base += 32) {
    const int g = base + lane;
    const int tiles = g < num_groups ? (offsets[g + 1] - offsets[g] + kTileM - 1) / kTileM : 0;
    int inclusive = tiles;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int up = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += up;
    }
    if (g < num_groups) tile_starts[g] = carry + inclusive - tiles;
    carry += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  if (lane == 0) tile_starts[num_groups] = carry;
}

template <bool kAKMajor, bool kBKMajor>
constexpr size_t smem_bytes() {
  return (kStages * (stage_elems<kAKMajor, kTileM>() + stage_elems<kBKMajor, kTileN>())) * sizeof(nvbf16) +
         (kThreads / 32) * 256 * sizeof(float);
}

template <bool kRowsMode, bool kBKMajor, bool kAligned, int kEpilogue>
void launch(const GroupedParams& params, dim3 grid, cudaStream_t stream) {
  constexpr size_t kSmem = smem_bytes<kRowsMode, kBKMajor>();
  static_assert(kSmem <= kSm80MaxSharedBytesPerBlock, "the fallback fits an sm_80 block");
  auto kernel = grouped_gemm_kernel<kRowsMode, kBKMajor, kAligned, kEpilogue>;
  // Above 48 KiB of dynamic shared memory needs the opt-in (a host-side attribute, no sync).
  static bool attribute_set = false;
  if (!attribute_set) {
    allow_dynamic_shared_memory(kernel, kSmem, "grouped GEMM (wmma)");
    attribute_set = true;
  }
  kernel<<<grid, kThreads, kSmem, stream>>>(params);
  CUDA_CHECK_LAUNCH();
}

// The mma.sync block tile for a caller's kernel choice (automatic: the default for the product kind).
grouped_gemm_detail::MmaTile mma_tile(GroupedGemmKernel kernel, grouped_gemm_detail::MmaTile automatic_tile) {
  if (kernel == GroupedGemmKernel::mma_128x128) return grouped_gemm_detail::MmaTile::square;
  if (kernel == GroupedGemmKernel::mma_128x256) return grouped_gemm_detail::MmaTile::wide;
  return automatic_tile;
}

template <bool kBKMajor, bool kAligned>
void launch_rows(const GroupedParams& params, DType c_dtype, dim3 grid, cudaStream_t stream) {
  if (c_dtype == DType::bf16)
    launch<true, kBKMajor, kAligned, kStoreBf16>(params, grid, stream);
  else
    launch<true, kBKMajor, kAligned, kStoreF32>(params, grid, stream);
}

}  // namespace

void grouped_gemm_rows_cuda(const __nv_bfloat16* a, const __nv_bfloat16* b, bool b_stored_nk, void* c, DType c_dtype,
                            const int32_t* offsets, int64_t num_groups, int64_t max_rows, int64_t n, int64_t k,
                            void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  grouped_gemm_rows_cuda_with(GroupedGemmKernel::automatic, a, b, b_stored_nk, c, c_dtype, offsets, num_groups,
                              max_rows, n, k, workspace, workspace_bytes, stream);
}

void grouped_gemm_weight_grad_cuda(const __nv_bfloat16* a, const __nv_bfloat16* b, void* c, DType c_dtype,
                                   const int32_t* offsets, int64_t num_groups, int64_t m, int64_t n,
                                   WeightGradOutput output, cudaStream_t stream, const WeightGradSquares* squares) {
  grouped_gemm_weight_grad_cuda_with(GroupedGemmKernel::automatic, a, b, c, c_dtype, offsets, num_groups, m, n,
                                     output, stream, squares);
}

void grouped_gemm_rows_cuda_with(GroupedGemmKernel kernel, const __nv_bfloat16* a, const __nv_bfloat16* b,
                                 bool b_stored_nk, void* c, DType c_dtype, const int32_t* offsets, int64_t num_groups,
                                 int64_t max_rows, int64_t n, int64_t k, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream) {
  if (kernel == GroupedGemmKernel::wgmma) require_sm90a_kernels("grouped_gemm_rows_cuda_with(wgmma)");
  CHECK(num_groups >= 1 && num_groups < (1 << 20), "grouped_gemm_rows_cuda: group count ", num_groups,
        " must be in [1, 2^20)");
  CHECK(n >= 1 && k >= 1 && max_rows >= 0, "grouped_gemm_rows_cuda: sizes n=", n, " k=", k, " max_rows=", max_rows,
        " must be positive");
  CHECK(max_rows < (int64_t{1} << 31) && std::max(n, k) < (int64_t{1} << 31),
        "grouped_gemm_rows_cuda: sizes too large for 32-bit indices (rows=", max_rows, " n=", n, " k=", k, ")");
  CHECK(c_dtype == DType::bf16 || c_dtype == DType::f32, "grouped_gemm_rows_cuda: output must be nvbf16 or f32, got ",
        dtype_name(c_dtype));
  CHECK(workspace_bytes >= grouped_gemm_rows_workspace_bytes(num_groups), "grouped_gemm_rows_cuda: workspace of ",
        workspace_bytes, " bytes, need ", grouped_gemm_rows_workspace_bytes(num_groups));
  if (max_rows == 0) return;
  int32_t* tile_starts = static_cast<int32_t*>(workspace);
  build_tile_starts_kernel<<<1, 32, 0, stream>>>(offsets, static_cast<int>(num_groups), tile_starts);
  CUDA_CHECK_LAUNCH();

  const bool mma_aligned = grouped_gemm_detail::mma_applies(a, b, c, n, k);
  if ((kernel == GroupedGemmKernel::automatic || kernel == GroupedGemmKernel::wgmma) && mma_aligned &&
      grouped_gemm_detail::wgmma_available()) {
    grouped_gemm_detail::rows_wgmma(a, b, b_stored_nk, c, c_dtype, offsets, tile_starts, static_cast<int>(num_groups),
                                    max_rows, static_cast<int>(n), static_cast<int>(k), stream);
    return;
  }
  if (kernel != GroupedGemmKernel::wmma && mma_aligned) {
    grouped_gemm_detail::rows_mma(mma_tile(kernel, kRowsMmaTile), a, b, b_stored_nk, c, c_dtype, offsets, tile_starts,
                                  static_cast<int>(num_groups), max_rows, static_cast<int>(n), static_cast<int>(k),
                                  stream);
    return;
  }

  GroupedParams params{
      a, b, c, offsets, tile_starts, static_cast<int>(num_groups), 0, static_cast<int>(n), static_cast<int>(k)};
  const int64_t max_tiles = (max_rows + kTileM - 1) / kTileM + num_groups;
  const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((n + kTileN - 1) / kTileN));
  // 16-byte paths need every contiguous extent (k of A; k or n of B; n of C) a multiple of 8.
  const bool aligned = k % 8 == 0 && n % 8 == 0 && aligned16(a) && aligned16(b) && aligned16(c);
  if (b_stored_nk) {
    if (aligned)
      launch_rows<true, true>(params, c_dtype, grid, stream);
    else
      launch_rows<true, false>(params, c_dtype, grid, stream);
  } else {
    if (aligned)
      launch_rows<false, true>(params, c_dtype, grid, stream);
    else
      launch_rows<false, false>(params, c_dtype, grid, stream);
  }
}

namespace {

// dW on the mma.sync or WMMA kernel, which only add: "written" is a zeroing pass, then the sum
// (bf16: bf16_rn(0 + product), the written value).
void weight_grad_by_addition(GroupedGemmKernel kernel, const __nv_bfloat16* a, const __nv_bfloat16* b, void* c,
                             DType c_dtype, const int32_t* offsets, int64_t num_groups, int64_t m, int64_t n,
                             WeightGradOutput output, bool mma_aligned, cudaStream_t stream) {
  if (output == WeightGradOutput::written)
    CUDA_CHECK(cudaMemsetAsync(c, 0, static_cast<size_t>(num_groups * m * n) * dtype_size(c_dtype), stream));
  if (kernel != GroupedGemmKernel::wmma && mma_aligned) {
    grouped_gemm_detail::weight_grad_mma(mma_tile(kernel, kWeightGradMmaTile), a, b, c, c_dtype, offsets,
                                         static_cast<int>(num_groups), static_cast<int>(m), static_cast<int>(n),
                                         stream);
    return;
  }
  GroupedParams params{
      a, b, c, offsets, nullptr, static_cast<int>(num_groups), static_cast<int>(m), static_cast<int>(n), 0};
  const dim3 grid(static_cast<unsigned>((m + kTileM - 1) / kTileM), static_cast<unsigned>((n + kTileN - 1) / kTileN),
                  static_cast<unsigned>(num_groups));
  const bool aligned = m % 8 == 0 && n % 8 == 0 && aligned16(a) && aligned16(b) && aligned16(c);
  if (c_dtype == DType::bf16) {
    if (aligned)
      launch<false, false, true, kAddBf16>(params, grid, stream);
    else
      launch<false, false, false, kAddBf16>(params, grid, stream);
  } else {
    if (aligned)
      launch<false, false, true, kAddF32>(params, grid, stream);
    else
      launch<false, false, false, kAddF32>(params, grid, stream);
  }
}

}  // namespace

void grouped_gemm_weight_grad_cuda_with(GroupedGemmKernel kernel, const __nv_bfloat16* a, const __nv_bfloat16* b,
                                        void* c, DType c_dtype, const int32_t* offsets, int64_t num_groups, int64_t m,
                                        int64_t n, WeightGradOutput output, cudaStream_t stream,
                                        const WeightGradSquares* squares) {
  if (kernel == GroupedGemmKernel::wgmma) require_sm90a_kernels("grouped_gemm_weight_grad_cuda_with(wgmma)");
  CHECK(c_dtype == DType::f32 || c_dtype == DType::bf16,
        "grouped_gemm_weight_grad_cuda: the gradient must be f32 or bf16, got ", dtype_name(c_dtype));
  CHECK(squares == nullptr || output == WeightGradOutput::written,
        "grouped_gemm_weight_grad_cuda: the sum of squares is formed for a written gradient only");
  CHECK(squares == nullptr || (squares->sum != nullptr && squares->scratch != nullptr && squares->divisor > 0),
        "grouped_gemm_weight_grad_cuda: the sum of squares needs its output, scratch and a positive divisor");
  CHECK(num_groups >= 1 && num_groups <= 65535, "grouped_gemm_weight_grad_cuda: group count ", num_groups,
        " must be in [1, 65535]");
  CHECK(m >= 1 && n >= 1, "grouped_gemm_weight_grad_cuda: sizes m=", m, " n=", n, " must be positive");
  CHECK(m < (int64_t{1} << 31) && n < (int64_t{1} << 31), "grouped_gemm_weight_grad_cuda: sizes m=", m, " n=", n,
        " too large for 32-bit indices");
  const bool mma_aligned = grouped_gemm_detail::mma_applies(a, b, c, m, n);
  if ((kernel == GroupedGemmKernel::automatic || kernel == GroupedGemmKernel::wgmma) &&
      output == WeightGradOutput::written && mma_aligned && grouped_gemm_detail::wgmma_available()) {
    grouped_gemm_detail::weight_grad_written_wgmma(a, b, c, c_dtype, offsets, static_cast<int>(num_groups),
                                                   static_cast<int>(m), static_cast<int>(n), stream, squares);
    return;
  }
  weight_grad_by_addition(kernel, a, b, c, c_dtype, offsets, num_groups, m, n, output, mma_aligned, stream);
  // These kernels store c with no hook for the squares: a pass over it (the stored values).
  if (squares != nullptr) {
    if (c_dtype == DType::bf16)
      sum_of_squares_cuda(static_cast<const __nv_bfloat16*>(c), num_groups * m * n, squares->divisor, squares->sum,
                          squares->scratch, stream);
    else
      sum_of_squares_cuda(static_cast<const float*>(c), num_groups * m * n, squares->divisor, squares->sum,
                          squares->scratch, stream);
  }
}

}  // namespace deltamoe
