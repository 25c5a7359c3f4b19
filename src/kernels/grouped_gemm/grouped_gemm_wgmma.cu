// Grouped GEMM row products on Hopper (sm_90a): wgmma m64n256k16 (bf16 in, fp32 accumulate) on
// operands that TMA loads into a 4-stage ring of 128-byte-swizzled shared tiles; one producer
// warpgroup issues the loads, two consumer warpgroups (64 rows each of a 128 x 256 block tile)
// issue the products; full / empty mbarriers hand stages between them; bf16 results leave through a
// swizzled shared staging tile by TMA stores (a group's last, partial tile by masked 16-byte
// stores). Persistent blocks walk the device-side tile list
// (group, m-tile, n-tile) built as for the mma.sync kernel (grouped_gemm_mma.cu, the portable path
// this one replaces on sm_90a). The "written" weight gradients (dW) run on a sibling kernel with
// the same consumers and a 3-stage ring, whose operands arrive by TMA for k-blocks wholly inside a
// group and by cp.async for each group's last, partial one (so that it stops exactly at its last
// row), and whose f32 or bf16 results leave by TMA stores from shared staging tiles; it can also sum
// the squares of what it stores, the gradient norm's share of those tensors.
#include <cuda.h>
#include <cudaTypedefs.h>

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

constexpr int kBlockM = kGroupedGemmTileRows;  // tile_starts counts tiles of this many rows
constexpr int kBlockN = 256;
constexpr int kBlockK = 64;  // one 128-byte swizzle line of bf16
constexpr int kStages = 4;
constexpr int kConsumers = 2;  // warpgroups of 64 rows each
constexpr int kConsumerRows = kBlockM / kConsumers;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kStageBytesA = kBlockM * kBlockK * 2;  // 16 KiB: 128 lines of 128 bytes
constexpr int kStageBytesB = kBlockN * kBlockK * 2;  // 32 KiB
constexpr int kStageBytes = kStageBytesA + kStageBytesB;
// bf16 results leave through a per-consumer staging tile of 64 rows x 128 columns (16 KiB, one
// half of the warpgroup's 64 x 256 at a time), so that global stores are whole 16-byte chunks.
constexpr int kStagingCols = 128;
constexpr int kStagingBytes = kConsumerRows * kStagingCols * 2;
// The stage ring (1024-byte aligned: the swizzle pattern repeats every 8 lines of 128 bytes),
// the staging tiles, then the 2 x kStages mbarriers; 1 KiB slack for aligning the dynamic base.
constexpr int kSmemBytes = kStages * kStageBytes + kConsumers * kStagingBytes + 2 * kStages * 8 + 1024;
static_assert(kSmemBytes <= 227 * 1024, "fits the opt-in shared memory of an sm_90 block");
// [K, N] weights (dX) arrive as boxes of 64 columns x 64 k lines, 8 KiB each.
constexpr int kBoxN = 64;
constexpr int kBoxBytesKN = kBoxN * kBlockK * 2;
static_assert(kStageBytes % 1024 == 0 && kStageBytesA % 1024 == 0, "stages keep the 1024-byte swizzle alignment");
static_assert(kBlockN / kBoxN * kBoxBytesKN == kStageBytesB, "the [K, N] boxes fill the B stage");
static_assert(kConsumerRows == 64, "one m64 wgmma per consumer warpgroup");

struct WgmmaParams {
  void* c;
  const int32_t* offsets;
  const int32_t* tile_starts;
  int num_groups;
  int n, k;
  int n_tiles;   // ceil(n / kBlockN)
  int k_blocks;  // ceil(k / kBlockK)
};

// Plain sm_90 code would carry this kernel with an empty body, and the kernel path
// (kernel_path_cuda.h) cannot tell it from sm_90a code: such a build is refused here.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && (__CUDA_ARCH__ < 1000) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "grouped_gemm_wgmma.cu: build Hopper code as sm_90a (wgmma and setmaxnreg), not sm_90"
#endif

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// The producer's arrival on a full barrier, announcing the bytes its copies will complete.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of the given parity has completed. The retry loop stays inside the asm
// (block-local labels): a loop the compiler sees would make the products after it look divergent,
// and ptxas would serialise them.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// A value the compiler then knows to be the same in every lane (what the warp reads from the same
// address anyway): branches on it are not divergent.
__device__ __forceinline__ int warp_uniform(int value) { return __shfl_sync(0xffffffffu, value, 0); }

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte
// offsets (all in 16-byte units), swizzle mode 1 in bits 62-63.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across the asynchronous products.
__device__ __forceinline__ void fence_accumulators(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D (64 x 256, f32, the warpgroup's fragment) = A (64 x 16) * B (16 x 256) + (scale_d ? D : 0).
// A k-major (kTransA 0: rows [R, K]) or m-major (kTransA 1: dW's [K, M] rows); B k-major (kTransB 0:
// weights [N, K]) or n-major (kTransB 1: weights [K, N], dW's [K, N] rows).
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                 int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, %131, %132;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
}

// One tile of the list: its group, first row and column, and how many of its 128 rows are the group's.
struct RowTile {
  int g, m0, n0, rows_valid;
};

// Tiles are numbered group by group, m-tile major and n-tile minor inside a group: blocks running
// together share a 128-row slice of A across the n-tiles and the group's weights in L2 (on the
// H200 this order beat n-major by 13-16% with 8 experts and ~2% with 256, docs/performance.md).
__device__ __forceinline__ RowTile decode_tile(const WgmmaParams& p, int tile) {
  const int g = find_tile_group(p.tile_starts, p.num_groups, tile, p.n_tiles);
  const int first = p.tile_starts[g];
  const int local = tile - first * p.n_tiles;
  const int m_index = local / p.n_tiles, n_index = local - m_index * p.n_tiles;
  RowTile t;
  t.g = g;
  t.m0 = p.offsets[g] + m_index * kBlockM;
  t.n0 = n_index * kBlockN;
  t.rows_valid = p.offsets[g + 1] - t.m0;
  return t;
}

// f32 results straight from the consumer's fragment to global memory: thread (warp w, lane l) holds rows
// 16w + l/4 and +8, columns 8j + 2(l%4) and +1 (pairs wholly valid or not: n % 8 == 0).
template <int kEpilogue>
__device__ __forceinline__ void store_fragment(const float (&d)[128], void* c, int64_t ldc, const RowTile& t,
                                               int row_first, int n, int lane) {
  const int col0 = t.n0 + 2 * (lane % 4);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row_first + half * 8;
    if (row >= t.rows_valid) continue;
    const int64_t line = static_cast<int64_t>(t.m0 + row) * ldc;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      const int col = col0 + 8 * j;
      if (col >= n) continue;
      const float v0 = d[4 * j + 2 * half], v1 = d[4 * j + 2 * half + 1];
      if constexpr (kEpilogue == kStoreBf16)
        *reinterpret_cast<__nv_bfloat162*>(static_cast<nvbf16*>(c) + line + col) = __floats2bfloat162_rn(v0, v1);
      else
        *reinterpret_cast<float2*>(static_cast<float*>(c) + line + col) = make_float2(v0, v1);
    }
  }
}

// A dW group's last, partial k-block arrives by cp.async (16-byte chunks, zero-filled past the
// group's last row or the matrix's last column): a TMA box there would cross into the next group's
// rows, which no tensor map can mask per group (whole in-group k-blocks go by TMA). Both operands
// are k-outer ([K, M] and [K, N] rows), so a stage holds 64-column boxes of 64 k lines (8 KiB
// each) in the 128-byte swizzle TMA writes: chunk c of line l at l * 128 + (c ^ (l % 8)) * 16.
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
// Arrives on the barrier once this thread's earlier cp.async copies have landed (counted in the
// barrier's initial count: .noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Makes the stage's cp.async writes (generic proxy) visible to the products (async proxy).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// A TMA store of one box from shared memory (the box's extent past the tensor is not written),
// and the issuing thread's bulk groups: commit, wait until their shared reads are done, wait until
// they are complete.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Until at most the most recent group is still reading shared memory.
__device__ __forceinline__ void bulk_wait_read_all_but_last() {
  asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// The warpgroup's named barrier (1 for the first consumer, 2 for the second), an immediate id.
__device__ __forceinline__ void sync_consumer(int consumer) {
  if (consumer == 0)
    asm volatile("bar.sync 1, 128;\n" ::: "memory");
  else
    asm volatile("bar.sync 2, 128;\n" ::: "memory");
}

__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1)
               : "memory");
}
// bf16 results of the warpgroup's 64 x 256 through its staging tile (16 KiB: two 64-row x
// 64-column boxes of 128-byte rows in the 128-byte swizzle: chunk c of row r at
// r * 128 + (c ^ (r % 8)) * 16), one 128-column half at a time. When all 64 rows are the group's,
// wg_thread 0 stores the boxes by TMA and the warpgroup goes on; a group's last tile is read back
// and stored by the threads, masked to the group's rows (a box would write into the next group's).
// Before a half is written, the previous stores have read the tile.
__device__ __forceinline__ void store_fragment_tma(const float (&d)[128], nvbf16* c, int64_t ldc, const RowTile& t,
                                                   int row_base, uint32_t staging, int n, int consumer, int warp,
                                                   int lane, int wg_thread, const CUtensorMap* map_c) {
  const bool whole = row_base + kConsumerRows <= t.rows_valid;
  // The thread's rows 16 warp + lane / 4 (+ 8: 1024 bytes on) share row % 8 = lane / 4; its pair
  // of column group j is chunk j % 8 of box j / 8, at byte 4 (lane % 4) of the chunk.
  const uint32_t thread_at = staging + static_cast<uint32_t>((warp * 16 + lane / 4) * 128 + (lane % 4) * 4);
  const uint32_t r8 = static_cast<uint32_t>(lane / 4);
#pragma unroll
  for (int h = 0; h < kBlockN / kStagingCols; ++h) {
    if (t.n0 + h * kStagingCols >= n) break;  // past n: nothing to store
    if (wg_thread == 0) bulk_wait_read_all();
    sync_consumer(consumer);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int j = 0; j < kStagingCols / 8; ++j) {
        const uint32_t at = thread_at + (j / 8) * 8192 + half * 1024 + (((j % 8) ^ r8) << 4);
        const int at_acc = 4 * (16 * h + j) + 2 * half;
        const __nv_bfloat162 v = __floats2bfloat162_rn(d[at_acc], d[at_acc + 1]);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(*reinterpret_cast<const uint32_t*>(&v)) : "memory");
      }
    }
    if (whole) {
      fence_proxy_async_shared();
      sync_consumer(consumer);
      if (wg_thread == 0) {
#pragma unroll
        for (int box = 0; box < kStagingCols / 64; ++box) {
          const int col = t.n0 + h * kStagingCols + box * 64;
          if (col < n) tma_store_2d(map_c, staging + box * 8192, col, t.m0 + row_base);
        }
        bulk_commit();
      }
    } else {
      sync_consumer(consumer);
#pragma unroll
      for (int q = 0; q < kConsumerRows * kStagingCols / 8 / 128; ++q) {
        const int i = wg_thread + q * 128;
        const int row = i / (kStagingCols / 8), chunk16 = i % (kStagingCols / 8);
        const int col = t.n0 + h * kStagingCols + chunk16 * 8;
        if (row_base + row < t.rows_valid && col < n) {
          uint4 v;
          const uint32_t at = staging + (chunk16 / 8) * 8192 + row * 128 + (((chunk16 % 8) ^ (row % 8)) * 16);
          asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                       : "r"(at));
          *reinterpret_cast<uint4*>(c + static_cast<int64_t>(t.m0 + row_base + row) * ldc + col) = v;
        }
      }
    }
  }
}

#endif  // sm_90a

// A [R, K] k-major through map_a (2D: K, rows); B_g [N, K] (kBKMajor, 3D map: K, N, G) or [K, N]
// (3D map: N, K, G); C [R, N] bf16 or f32. Rows and k past the maps' extents arrive as zeros;
// rows of a tile past its group's end are computed but not stored.
template <bool kBKMajor, int kEpilogue>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                              const __grid_constant__ CUtensorMap map_c, const WgmmaParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t ring = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t full_bars = ring + kStages * kStageBytes + kConsumers * kStagingBytes;  // stage filled
  const uint32_t empty_bars = full_bars + kStages * 8;      // stage consumed (every consumer warp)
  const int warpgroup = warp_uniform(static_cast<int>(threadIdx.x) / 128);
  const int warp = (static_cast<int>(threadIdx.x) % 128) / 32, lane = static_cast<int>(threadIdx.x) % 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_bars + 8 * s, 1);
      mbar_init(empty_bars + 8 * s, kConsumers * 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // the only block-wide barrier: the producer's idle warps leave after it

  const int total_tiles = warp_uniform(p.tile_starts[p.num_groups] * p.n_tiles);
  if (warpgroup == 0) {
    // Producer: one thread issues every copy; the warpgroup gives its registers to the consumers.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (warp != 0 || lane != 0) return;
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map_a)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map_b)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map_c)) : "memory");
    int it = 0;  // k-blocks issued so far: stage it % kStages, its (it / kStages)-th use
    for (int tile = static_cast<int>(blockIdx.x); tile < total_tiles; tile += static_cast<int>(gridDim.x)) {
      const RowTile t = decode_tile(p, tile);
      for (int kb = 0; kb < p.k_blocks; ++kb, ++it) {
        const int s = it % kStages;
        // A fresh barrier counts as having completed the phase before its first: the first round
        // of stages does not wait.
        mbar_wait(empty_bars + 8 * s, ((it / kStages) & 1) ^ 1);
        const uint32_t full = full_bars + 8 * s, a_dst = ring + s * kStageBytes, b_dst = a_dst + kStageBytesA;
        // Boxes partly or wholly outside the tensor still deliver their full size (as zeros).
        mbar_arrive_expect_tx(full, kStageBytes);
        tma_load_2d(a_dst, &map_a, full, kb * kBlockK, t.m0);
        if constexpr (kBKMajor) {
          tma_load_3d(b_dst, &map_b, full, kb * kBlockK, t.n0, t.g);
        } else {
#pragma unroll
          for (int j = 0; j < kBlockN / kBoxN; ++j)
            tma_load_3d(b_dst + j * kBoxBytesKN, &map_b, full, t.n0 + j * kBoxN, kb * kBlockK, t.g);
        }
      }
    }
    return;
  }

  // Consumers: warpgroup 1 takes rows 0-63 of each tile, warpgroup 2 rows 64-127.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int consumer = warpgroup - 1;
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  int it = 0;
  for (int tile = static_cast<int>(blockIdx.x); tile < total_tiles; tile += static_cast<int>(gridDim.x)) {
    const RowTile t = decode_tile(p, tile);
    // A group's last tile often holds fewer than 65 of its rows: the second warpgroup then only
    // keeps the stage hand-over going.
    const bool active = warp_uniform(t.rows_valid > consumer * kConsumerRows);
    int previous_stage = 0;
    for (int kb = 0; kb < p.k_blocks; ++kb, ++it) {
      const int s = it % kStages;
      mbar_wait(full_bars + 8 * s, (it / kStages) & 1);
      if (active) {
        const uint32_t a_stage = ring + s * kStageBytes + consumer * kConsumerRows * 128;
        const uint32_t b_stage = ring + s * kStageBytes + kStageBytesA;
        fence_accumulators(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) {
          // k-major: the next 16 k are 32 bytes further along each swizzled line, lines 128 bytes
          // apart, 8-line groups 1024. n-major B: 16 k lines further (2048 bytes); 64-column
          // boxes kBoxBytesKN apart.
          const uint64_t desc_a = smem_desc(a_stage + kk * 32, 16, 1024);
          const uint64_t desc_b = kBKMajor ? smem_desc(b_stage + kk * 32, 16, 1024)
                                           : smem_desc(b_stage + kk * 16 * 128, kBoxBytesKN, 1024);
          wgmma_m64n256k16<0, kBKMajor ? 0 : 1>(acc, desc_a, desc_b, (kb > 0 || kk > 0) ? 1 : 0);
        }
        wgmma_commit();
        // The previous k-block's products are done: its stage may be refilled.
        wgmma_wait<1>();
        fence_accumulators(acc);
      }
      if (kb > 0 && lane == 0) mbar_arrive(empty_bars + 8 * previous_stage);
      previous_stage = s;
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
    if (lane == 0) mbar_arrive(empty_bars + 8 * previous_stage);
    if (active) {
      if constexpr (kEpilogue == kStoreBf16) {
        store_fragment_tma(acc, static_cast<nvbf16*>(p.c), p.n, t, consumer * kConsumerRows,
                           ring + kStages * kStageBytes + consumer * kStagingBytes, p.n, consumer, warp, lane,
                           static_cast<int>(threadIdx.x) % 128, &map_c);
      } else {
        store_fragment<kEpilogue>(acc, p.c, p.n, t, consumer * kConsumerRows + warp * 16 + lane / 4, p.n, lane);
      }
    }
  }
  // The last stores have left shared memory (and landed) before the block exits.
  if (kEpilogue == kStoreBf16 && threadIdx.x % 128 == 0) bulk_wait_all();
#endif
}

// dW written: c_g [M, N] = a_g^T b_g over group g's rows, a [R, M] and b [R, N] both k-outer (K =
// the group's rows). Block tile 128 (m) x 256 (n): consumer warpgroup w takes m rows 64w .. 64w + 63,
// with A as the m-major operand (wgmma's transposed A) and B n-major. Tiles are numbered group by
// group, m-tile major: the ~132 tiles in flight cover about two groups, whose rows sit in L2.
// "Added to" stays on the mma.sync kernel: with c read in the epilogue this kernel measured 4-7%
// slower than it (grouped_gemm_notes.md).
struct WeightGradParams {
  const nvbf16* a;
  const nvbf16* b;
  void* c;  // float or nvbf16 (the kernel's Out)
  const int32_t* offsets;
  int num_groups, m, n;
  int m_tiles, n_tiles;  // ceil(m / kBlockM), ceil(n / kBlockN)
  // The squares of the stored values, times squares_scale (1 / divisor^2), one fp64 sum per
  // consumer warp: warp_sums[block * 8 + consumer warp] (kSquares only).
  double* warp_sums;
  double squares_scale;
};

constexpr int kWeightGradBox = 64 * kBlockK * 2;  // 64 columns x 64 k lines of bf16: 8 KiB
// Three stages (a group's ~4 k-blocks at the 35B shapes), leaving room for the f32 staging tiles:
// each consumer warpgroup's 64 rows leave in kWeightGradStagingCols-column parts through its own
// staging tile, as TMA stores of 64-row x 32-column boxes (128-byte rows in the 128-byte swizzle),
// so that the warpgroup goes on to the next tile while the copy engine drains the last part.
// The staging tile is two buffers of one 64-column part each, used in turn: the warpgroup writes
// a part while the copy engine still reads the one before it (measured on an H100, the step's
// form with squares: gate_up 1.04 against 1.16 ms with one 128-column part at a time).
// A bf16 part's rows are 128 bytes: one 64-row x 64-column box; the four of a warpgroup's tile fill
// its staging, so bf16 tiles leave whole (the epilogue below).
constexpr int kWeightGradStages = 3;
constexpr int kWeightGradStagingCols = 64;
constexpr int kWeightGradStagingBuffers = 2;
constexpr int kWeightGradStoreBoxCols = 32;
constexpr int kWeightGradStoreBoxBytes = 64 * kWeightGradStoreBoxCols * 4;  // 8 KiB
constexpr int kWeightGradStagingBufferBytes = 64 * kWeightGradStagingCols * 4;                      // 16 KiB
constexpr int kWeightGradStagingBytes = kWeightGradStagingBuffers * kWeightGradStagingBufferBytes;  // 32 KiB
constexpr int kWeightGradSmemBytes = kWeightGradStages * kStageBytes + kConsumers * kWeightGradStagingBytes +
                                     2 * kWeightGradStages * 8 + 1024;
static_assert(kWeightGradSmemBytes <= 227 * 1024, "fits the opt-in shared memory of an sm_90 block");
static_assert(kBlockN % kWeightGradStagingCols == 0 && kWeightGradStagingCols % kWeightGradStoreBoxCols == 0,
              "whole parts of whole boxes");
static_assert(kWeightGradStagingBufferBytes ==
                  kWeightGradStagingCols / kWeightGradStoreBoxCols * kWeightGradStoreBoxBytes,
              "a staging buffer is its store boxes side by side");
static_assert((kWeightGradStages * kStageBytes) % 1024 == 0 && kWeightGradStagingBufferBytes % 1024 == 0,
              "staging tiles keep the 1024-byte swizzle alignment");
constexpr int kWeightGradBf16BoxBytes = 64 * kWeightGradStagingCols * 2;  // 8 KiB
static_assert(kWeightGradStagingCols * 2 == 128 && kBlockN / kWeightGradStagingCols * kWeightGradBf16BoxBytes ==
                                                       kWeightGradStagingBytes,
              "a bf16 part is one box of 128-byte rows (one swizzle line each); a warpgroup's whole bf16 tile "
              "fills its staging");
constexpr int kProducerThreads = 128;
static_assert(kBlockM / 64 * kWeightGradBox == kStageBytesA && kBlockN / 64 * kWeightGradBox == kStageBytesB,
              "dW stages are whole 64-column boxes");
static_assert(kBlockM * kBlockK / 8 == 8 * kProducerThreads && kBlockN * kBlockK / 8 == 16 * kProducerThreads,
              "each producer thread copies 8 chunks of A and 16 of B per stage");

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

struct WeightGradTile {
  int g, m0, n0, r0, k_extent, k_blocks;
};

__device__ __forceinline__ WeightGradTile weight_grad_tile(const WeightGradParams& p, int tile) {
  const int per_group = p.m_tiles * p.n_tiles;
  WeightGradTile t;
  t.g = tile / per_group;
  const int local = tile - t.g * per_group;
  const int m_index = local / p.n_tiles;
  t.m0 = m_index * kBlockM;
  t.n0 = (local - m_index * p.n_tiles) * kBlockN;
  t.r0 = p.offsets[t.g];
  t.k_extent = p.offsets[t.g + 1] - t.r0;
  t.k_blocks = (t.k_extent + kBlockK - 1) / kBlockK;
  return t;
}

#endif  // sm_90a

// Out: float or nvbf16, the type of c (map_c's elements).
template <typename Out, bool kSquares>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_weight_grad_wgmma_kernel(const __grid_constant__ CUtensorMap map_a,
                                          const __grid_constant__ CUtensorMap map_b,
                                          const __grid_constant__ CUtensorMap map_c, const WeightGradParams p) {
  static_assert(std::is_same_v<Out, nvbf16> || std::is_same_v<Out, float>, "dW is stored as f32 or bf16");
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kBf16 = std::is_same_v<Out, nvbf16>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t ring = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t staging_tiles = ring + kWeightGradStages * kStageBytes;
  const uint32_t full_bars = staging_tiles + kConsumers * kWeightGradStagingBytes;  // stage filled (every producer thread's copies)
  const uint32_t empty_bars = full_bars + kWeightGradStages * 8;  // stage consumed (every consumer warp)
  const int warpgroup = warp_uniform(static_cast<int>(threadIdx.x) / 128);
  const int warp = (static_cast<int>(threadIdx.x) % 128) / 32, lane = static_cast<int>(threadIdx.x) % 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kWeightGradStages; ++s) {
      mbar_init(full_bars + 8 * s, kProducerThreads);
      mbar_init(empty_bars + 8 * s, kConsumers * 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int total_tiles = p.num_groups * p.m_tiles * p.n_tiles;
  if (warpgroup == 0) {
    // Producer: every thread copies its share of each stage and arrives when its copies land (56
    // registers: its address arithmetic spills at 40; 128 x 56 + 256 x 224 fit the 64 Ki file).
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
    const int t = static_cast<int>(threadIdx.x);
    if (t == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map_a)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map_b)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map_c)) : "memory");
    }
    // A: thread t copies chunk t % 16 of k lines t / 16 + 8j (the 128 m columns are 16 chunks, two
    // boxes); B: chunk t % 32 of k lines t / 32 + 4j (256 n columns, four boxes).
    const int a_line = t / 16, a_col = (t % 16) * 8, b_line = t / 32, b_col = (t % 32) * 8;
    const uint32_t a_dst = (a_col / 64) * kWeightGradBox + a_line * 128 + (((a_col / 8) % 8) ^ (a_line % 8)) * 16;
    const uint32_t b_box = (b_col / 64) * kWeightGradBox;
    const int b_chunk = (b_col / 8) % 8;
    int it = 0;  // k-blocks issued so far: stage it % kWeightGradStages, its (it / kWeightGradStages)-th use
    for (int tile = static_cast<int>(blockIdx.x); tile < total_tiles; tile += static_cast<int>(gridDim.x)) {
      const WeightGradTile w = weight_grad_tile(p, tile);
      const bool a_col_ok = w.m0 + a_col < p.m, b_col_ok = w.n0 + b_col < p.n;
      const nvbf16* a_src = p.a + static_cast<int64_t>(w.r0) * p.m + w.m0 + a_col;
      const nvbf16* b_src = p.b + static_cast<int64_t>(w.r0) * p.n + w.n0 + b_col;
      for (int kb = 0; kb < w.k_blocks; ++kb, ++it) {
        const int s = it % kWeightGradStages;
        mbar_wait(empty_bars + 8 * s, ((it / kWeightGradStages) & 1) ^ 1);
        const uint32_t a_stage = ring + s * kStageBytes, b_stage = a_stage + kStageBytesA;
        const int k0 = kb * kBlockK;
        if (k0 + kBlockK <= w.k_extent) {
          // A k-block wholly inside the group arrives by TMA: thread 0 announces its bytes and
          // issues the boxes (columns past m or n arrive as zeros), the others just arrive.
          if (t == 0) {
            mbar_arrive_expect_tx(full_bars + 8 * s, kStageBytes);
#pragma unroll
            for (int j = 0; j < kBlockM / 64; ++j)
              tma_load_2d(a_stage + j * kWeightGradBox, &map_a, full_bars + 8 * s, w.m0 + 64 * j, w.r0 + k0);
#pragma unroll
            for (int j = 0; j < kBlockN / 64; ++j)
              tma_load_2d(b_stage + j * kWeightGradBox, &map_b, full_bars + 8 * s, w.n0 + 64 * j, w.r0 + k0);
          } else {
            mbar_arrive(full_bars + 8 * s);
          }
          continue;
        }
        // Lines past the group's last row (the next group's rows, or past the end) are zero-filled.
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int k = k0 + a_line + 8 * j;
          const bool ok = a_col_ok && k < w.k_extent;
          cp_async_16_zfill(a_stage + a_dst + j * 1024, ok ? a_src + static_cast<int64_t>(k) * p.m : p.a, ok);
        }
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int line = b_line + 4 * j, k = k0 + line;
          const bool ok = b_col_ok && k < w.k_extent;
          cp_async_16_zfill(b_stage + b_box + line * 128 + ((b_chunk ^ (line % 8)) * 16),
                            ok ? b_src + static_cast<int64_t>(k) * p.n : p.b, ok);
        }
        cp_async_arrive_noinc(full_bars + 8 * s);
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
  const int consumer = warpgroup - 1;
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  // This thread's stored values' squares (kSquares), undivided, over all its tiles in order, in four
  // fp64 sums so that the additions do not form one chain; the divisor's 1 / d^2 scales the warp's
  // total. A quotient per element (three fp32 operations a value) costs the kernel ~20% (an H100:
  // 1.16 against 0.97 ms on gate_up). f32 c: each square exact in fp64, summed by column (J % 4).
  // bf16 c: the stored (rounded) values, whose squares are exact in fp32 (8 significant bits);
  // a pair's two squares are summed by one fp32 FMA and the eight pairs of a part's row by a
  // fixed fp32 tree, then widened once: one conversion and one fp64 add per 16 values instead of
  // 16 of each (the fp64 form cost 0.22 of 0.78 ms on gate_up, an H200), at most four fp32
  // roundings deep (kWrittenSquaresRelErrorBf16).
  [[maybe_unused]] double squares[4] = {0.0, 0.0, 0.0, 0.0};
  const int wg_thread = static_cast<int>(threadIdx.x) % 128;
  // Where this thread's float2 of column group j lands in a staging box: its rows (16 warp +
  // lane / 4, and + 8 at +1024 bytes) share row % 8 = lane / 4, and its 8 bytes are chunk
  // 2 (j % 4) + (lane % 4) / 2 of the 128-byte row, at byte (lane % 2) * 8 of the chunk.
  // The chunk is (2 (j % 4)) ^ chunk_xor, the two terms having no bit in common before the xor.
  const uint32_t staging = staging_tiles + consumer * kWeightGradStagingBytes;
  [[maybe_unused]] const uint32_t thread_staging =
      staging + static_cast<uint32_t>((warp * 16 + lane / 4) * 128 + (lane % 2) * 8);
  [[maybe_unused]] const uint32_t chunk_xor = static_cast<uint32_t>(((lane % 4) / 2) ^ (lane / 4));
  // bf16: the thread's __nv_bfloat162 of column group j (0-7 in the part) is 4 bytes at byte
  // 4 (lane % 4) of chunk j of its 128-byte row, swizzled to chunk j ^ (lane / 4) (row % 8 = lane / 4
  // for both rows). A warp's 4-byte stores then hit bank 4 (j ^ (lane / 4)) + lane % 4: 32 distinct.
  [[maybe_unused]] const uint32_t thread_staging_bf16 =
      staging + static_cast<uint32_t>((warp * 16 + lane / 4) * 128 + (lane % 4) * 4);
  [[maybe_unused]] const uint32_t row_xor = static_cast<uint32_t>(lane / 4);
  int it = 0, parts_issued = 0;
  for (int tile = static_cast<int>(blockIdx.x); tile < total_tiles; tile += static_cast<int>(gridDim.x)) {
    const WeightGradTile w = weight_grad_tile(p, tile);
    const int row_base = w.m0 + consumer * 64;
    const bool active = warp_uniform(row_base < p.m);
    const int rows_valid = p.m - row_base, cols_valid = p.n - w.n0;
    if (w.k_blocks == 0) {
      // A group without rows: zeros, stored straight from registers (zeroing the accumulators for
      // the staged path made ptxas spill them).
      if (active) {
        Out* c_tile =
            static_cast<Out*>(p.c) + (static_cast<int64_t>(w.g) * p.m + row_base) * p.n + w.n0 + 2 * (lane % 4);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = warp * 16 + lane / 4 + half * 8;
          if (row >= rows_valid) continue;
#pragma unroll 4
          for (int j = 0; j < kBlockN / 8; ++j) {
            if (8 * j >= cols_valid) continue;
            Out* pair = c_tile + static_cast<int64_t>(row) * p.n + 8 * j;
            if constexpr (kBf16)
              *reinterpret_cast<__nv_bfloat162*>(pair) = __floats2bfloat162_rn(0.0f, 0.0f);
            else
              *reinterpret_cast<float2*>(pair) = make_float2(0.0f, 0.0f);
          }
        }
      }
      continue;
    }
    int previous_stage = 0;
    for (int kb = 0; kb < w.k_blocks; ++kb, ++it) {
      const int s = it % kWeightGradStages;
      mbar_wait(full_bars + 8 * s, (it / kWeightGradStages) & 1);
      if (active) {
        fence_proxy_async_shared();
        const uint32_t a_box = ring + s * kStageBytes + consumer * kWeightGradBox;
        const uint32_t b_stage = ring + s * kStageBytes + kStageBytesA;
        fence_accumulators(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) {
          // Both operands n-/m-major: the next 16 k are 16 lines further (2048 bytes), 64-column
          // boxes kWeightGradBox apart, 8-line groups 1024.
          const uint64_t desc_a = smem_desc(a_box + kk * 2048, kWeightGradBox, 1024);
          const uint64_t desc_b = smem_desc(b_stage + kk * 2048, kWeightGradBox, 1024);
          wgmma_m64n256k16<1, 1>(acc, desc_a, desc_b, (kb > 0 || kk > 0) ? 1 : 0);
        }
        wgmma_commit();
        wgmma_wait<1>();
        fence_accumulators(acc);
      }
      if (kb > 0 && lane == 0) mbar_arrive(empty_bars + 8 * previous_stage);
      previous_stage = s;
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
    if (lane == 0) mbar_arrive(empty_bars + 8 * previous_stage);
    if (!active) continue;
    // Thread (warp, lane) holds rows 16 warp + lane / 4 and + 8, columns 8J + 2 (lane % 4) and + 1.
    if constexpr (kBf16) {
      // bf16: the warpgroup's whole 64 x 256 tile fits its staging (four 64 x 64 boxes of 128-byte
      // rows, 8 KiB each), so the epilogue waits once, for the previous tile's stores to have read
      // the staging (long done: they were issued before this tile's products), writes every part,
      // and hands all boxes to TMA in one group; the stores then drain during the next tile's
      // products instead of between the parts. A thread's bf16 pair of column group j of a part
      // goes to chunk j ^ (row % 8) of its row, byte 4 (lane % 4): a warp's stores hit every bank once.
      if (wg_thread == 0) bulk_wait_read_all();
      sync_consumer(consumer);
#pragma unroll
      for (int part = 0; part < kBlockN / kWeightGradStagingCols; ++part) {
        if (part * kWeightGradStagingCols >= cols_valid) break;  // past n: nothing to store
        const uint32_t box = static_cast<uint32_t>(part) * kWeightGradBf16BoxBytes;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = warp * 16 + lane / 4 + half * 8;
          [[maybe_unused]] float pair_squares[kWeightGradStagingCols / 8];
#pragma unroll
          for (int j = 0; j < kWeightGradStagingCols / 8; ++j) {
            const int J = part * (kWeightGradStagingCols / 8) + j;  // the column group in the tile
            const __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * J + 2 * half], acc[4 * J + 2 * half + 1]);
            const uint32_t at =
                thread_staging_bf16 + box + half * 1024 + ((static_cast<uint32_t>(j) ^ row_xor) << 4);
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(*reinterpret_cast<const uint32_t*>(&v))
                         : "memory");
            if constexpr (kSquares) {
              const float q0 = __low2float(v), q1 = __high2float(v);
              pair_squares[j] = (row < rows_valid && 8 * J < cols_valid) ? __fmaf_rn(q1, q1, q0 * q0) : 0.0f;
            }
          }
          if constexpr (kSquares) {
            const float quad0 = (pair_squares[0] + pair_squares[1]) + (pair_squares[2] + pair_squares[3]);
            const float quad1 = (pair_squares[4] + pair_squares[5]) + (pair_squares[6] + pair_squares[7]);
            squares[2 * (part % 2) + half] += static_cast<double>(quad0 + quad1);
          }
        }
      }
      fence_proxy_async_shared();
      sync_consumer(consumer);
      if (wg_thread == 0) {
#pragma unroll
        for (int part = 0; part < kBlockN / kWeightGradStagingCols; ++part) {
          if (part * kWeightGradStagingCols >= cols_valid) break;
          tma_store_3d(&map_c, staging + part * kWeightGradBf16BoxBytes, w.n0 + part * kWeightGradStagingCols,
                       row_base, w.g);
        }
        bulk_commit();
      }
    } else {
      // f32: the tile (64 KiB a warpgroup) does not fit the staging, so it leaves one
      // kWeightGradStagingCols-column part at a time, the parts in the staging
      // buffers in turn (parts_issued counts them over all tiles, so that the buffer written next is
      // never the one whose stores were issued last): wait until the buffer's previous stores have
      // read it (the thread that issued them; the latest group, the other buffer's, may still be
      // reading), write the part in the boxes' swizzle (chunk c of row r at r * 128 + (c ^ (r % 8)) *
      // 16; a warp's float2 stores then fill every bank twice), make it visible to the async proxy,
      // and let one thread store its two boxes of 32 columns.
#pragma unroll
      for (int part = 0; part < kBlockN / kWeightGradStagingCols; ++part) {
        if (part * kWeightGradStagingCols >= cols_valid) break;  // past n: nothing to store
        const uint32_t buffer =
            static_cast<uint32_t>(parts_issued % kWeightGradStagingBuffers) * kWeightGradStagingBufferBytes;
        ++parts_issued;
        if (wg_thread == 0) bulk_wait_read_all_but_last();
        sync_consumer(consumer);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = warp * 16 + lane / 4 + half * 8;
#pragma unroll
          for (int j = 0; j < kWeightGradStagingCols / 8; ++j) {
            const int J = part * (kWeightGradStagingCols / 8) + j;  // the column group in the tile
            const float x0 = acc[4 * J + 2 * half], x1 = acc[4 * J + 2 * half + 1];
            const int box = 8 * j / kWeightGradStoreBoxCols;  // the quad's 8 columns lie in one box
            const uint32_t at = thread_staging + buffer + box * kWeightGradStoreBoxBytes + half * 1024 +
                                (((2 * (j % 4)) ^ chunk_xor) << 4);
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(x0), "f"(x1) : "memory");
            if constexpr (kSquares) {
              if (row < rows_valid && 8 * J < cols_valid) {
                const double q0 = x0, q1 = x1;
                squares[J % 4] = __fma_rn(q1, q1, __fma_rn(q0, q0, squares[J % 4]));
              }
            }
          }
        }
        fence_proxy_async_shared();
        sync_consumer(consumer);
        if (wg_thread == 0) {
#pragma unroll
          for (int box = 0; box < kWeightGradStagingCols / kWeightGradStoreBoxCols; ++box) {
            const int col = part * kWeightGradStagingCols + box * kWeightGradStoreBoxCols;
            if (col < cols_valid)
              tma_store_3d(&map_c, staging + buffer + box * kWeightGradStoreBoxBytes, w.n0 + col, row_base, w.g);
          }
          bulk_commit();
        }
      }
    }
  }
  // The last stores have left shared memory (and landed) before the block exits.
  if (wg_thread == 0) bulk_wait_all();
  if constexpr (kSquares) {
    // The four sums in a fixed pairing, lanes in xor order, then one slot per consumer warp (every
    // warp of the block writes its own, zero if it stored nothing), so the sum is the same every
    // call on the same GPU.
    double sum = (squares[0] + squares[1]) + (squares[2] + squares[3]);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) p.warp_sums[blockIdx.x * (kConsumers * 4) + consumer * 4 + warp] = sum * p.squares_scale;
  }
#endif
}

// cuTensorMapEncodeTiled from the driver, found through the runtime (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000, cudaEnableDefault, &found));
    CHECK(found == cudaDriverEntryPointSuccess && entry != nullptr,
          "grouped GEMM (wgmma): the driver has no cuTensorMapEncodeTiled");
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(entry);
  }
  return encode;
}

// A tensor map with 128-byte swizzled boxes; dims innermost first, strides in bytes for dims 1..
// (the launcher checked 16-byte alignment of base and strides).
CUtensorMap swizzled_tensor_map(CUtensorMapDataType type, const void* base, cuuint32_t rank, const cuuint64_t* dims,
                                const cuuint64_t* strides, const cuuint32_t* box) {
  CUtensorMap map;
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult result = tensor_map_encoder()(
      &map, type, rank, const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  CHECK(result == CUDA_SUCCESS, "grouped GEMM (wgmma): cuTensorMapEncodeTiled failed (", static_cast<int>(result),
        ") for a rank-", rank, " map of ", dims[0], " x ", dims[1], rank > 2 ? " x " : "", rank > 2 ? dims[2] : 0);
  return map;
}

CUtensorMap bf16_tensor_map(const void* base, cuuint32_t rank, const cuuint64_t* dims, const cuuint64_t* strides,
                            const cuuint32_t* box) {
  return swizzled_tensor_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, base, rank, dims, strides, box);
}

CUtensorMap f32_tensor_map(const void* base, cuuint32_t rank, const cuuint64_t* dims, const cuuint64_t* strides,
                           const cuuint32_t* box) {
  return swizzled_tensor_map(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, base, rank, dims, strides, box);
}

template <bool kBKMajor, int kEpilogue>
void launch(const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_c, const WgmmaParams& params,
            int64_t max_tiles, cudaStream_t stream) {
  auto kernel = grouped_gemm_wgmma_kernel<kBKMajor, kEpilogue>;
  static bool attribute_set = false;  // a host-side attribute, no sync
  if (!attribute_set) {
    allow_dynamic_shared_memory(kernel, kSmemBytes, "grouped GEMM (wgmma)");
    attribute_set = true;
  }
  int device = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(max_tiles, sms)));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(map_a, map_b, map_c, params);
  CUDA_CHECK_LAUNCH();
}

// The grid: one persistent block per SM (at most one per tile); with squares at most
// kMaxSquaresBlocks, the warp sums the scratch holds.
constexpr int kMaxSquaresBlocks = 256;
static_assert(kWeightGradSquaresScratchBytes >=
                  kSumOfSquaresWorkspaceBytes + kMaxSquaresBlocks * kConsumers * 4 * sizeof(double),
              "the squares scratch holds every consumer warp's sum");

template <typename Out, bool kSquares>
void launch_weight_grad(const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_c,
                        const WeightGradParams& params, unsigned grid, cudaStream_t stream) {
  auto kernel = grouped_gemm_weight_grad_wgmma_kernel<Out, kSquares>;
  static bool attribute_set = false;  // a host-side attribute, no sync
  if (!attribute_set) {
    allow_dynamic_shared_memory(kernel, kWeightGradSmemBytes, "grouped GEMM dW (wgmma)");
    attribute_set = true;
  }
  kernel<<<grid, kThreads, kWeightGradSmemBytes, stream>>>(map_a, map_b, map_c, params);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool wgmma_available() {
  // The process-wide answer (kernels/common/kernel_path_cuda.h): an sm_90 GPU running sm_90a code.
  // Where it is no (an A800, or compute_80 PTX compiled for the H200 at load time), this kernel's
  // copy in the binary is empty and must not run.
  return sm90a_kernels_usable();
}

void rows_wgmma(const __nv_bfloat16* a, const __nv_bfloat16* b, bool b_stored_nk, void* c, DType c_dtype,
                const int32_t* offsets, const int32_t* tile_starts, int num_groups, int64_t max_rows, int n, int k,
                cudaStream_t stream) {
  CHECK(mma_applies(a, b, c, n, k), "grouped GEMM (wgmma): n=", n, " and k=", k,
        " must be multiples of 8 and the operands 16-byte aligned");
  require_sm90a_kernels("grouped GEMM (wgmma)");
  const cuuint64_t row_bytes = static_cast<cuuint64_t>(k) * 2;
  const cuuint64_t a_dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(max_rows)};
  const cuuint64_t a_strides[1] = {row_bytes};
  const cuuint32_t a_box[2] = {kBlockK, kBlockM};
  const CUtensorMap map_a = bf16_tensor_map(a, 2, a_dims, a_strides, a_box);
  const cuuint64_t group_bytes = static_cast<cuuint64_t>(n) * k * 2;
  CUtensorMap map_b;
  if (b_stored_nk) {
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(n),
                                static_cast<cuuint64_t>(num_groups)};
    const cuuint64_t strides[2] = {row_bytes, group_bytes};
    const cuuint32_t box[3] = {kBlockK, kBlockN, 1};
    map_b = bf16_tensor_map(b, 3, dims, strides, box);
  } else {
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(n), static_cast<cuuint64_t>(k),
                                static_cast<cuuint64_t>(num_groups)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(n) * 2, group_bytes};
    const cuuint32_t box[3] = {kBoxN, kBlockK, 1};
    map_b = bf16_tensor_map(b, 3, dims, strides, box);
  }
  WgmmaParams params{c, offsets, tile_starts, num_groups, n, k, (n + kBlockN - 1) / kBlockN,
                     (k + kBlockK - 1) / kBlockK};
  // Every group wastes at most one partial tile: the device-side count is at most this.
  const int64_t max_tiles = ((max_rows + kBlockM - 1) / kBlockM + num_groups) * params.n_tiles;
  CHECK(max_tiles < (int64_t{1} << 31), "grouped GEMM (wgmma): ", max_tiles, " tiles overflow 32-bit tile indices");
  // c [max_rows, n] bf16 as 64 x 64 boxes, for the TMA-store epilogue (unused for f32 c).
  CUtensorMap map_c{};
  if (c_dtype == DType::bf16) {
    const cuuint64_t c_dims[2] = {static_cast<cuuint64_t>(n), static_cast<cuuint64_t>(max_rows)};
    const cuuint64_t c_strides[1] = {static_cast<cuuint64_t>(n) * 2};
    const cuuint32_t c_box[2] = {64, 64};
    map_c = bf16_tensor_map(c, 2, c_dims, c_strides, c_box);
  }
  if (b_stored_nk) {
    if (c_dtype == DType::bf16)
      launch<true, kStoreBf16>(map_a, map_b, map_c, params, max_tiles, stream);
    else
      launch<true, kStoreF32>(map_a, map_b, map_c, params, max_tiles, stream);
  } else {
    if (c_dtype == DType::bf16)
      launch<false, kStoreBf16>(map_a, map_b, map_c, params, max_tiles, stream);
    else
      launch<false, kStoreF32>(map_a, map_b, map_c, params, max_tiles, stream);
  }
}

void weight_grad_written_wgmma(const __nv_bfloat16* a, const __nv_bfloat16* b, void* c, DType c_dtype,
                               const int32_t* offsets, int num_groups, int m, int n, cudaStream_t stream,
                               const WeightGradSquares* squares) {
  CHECK(mma_applies(a, b, c, m, n), "grouped GEMM dW (wgmma): m=", m, " and n=", n,
        " must be multiples of 8 and the operands 16-byte aligned");
  CHECK(c_dtype == DType::f32 || c_dtype == DType::bf16,
        "grouped GEMM dW (wgmma): the gradient must be f32 or bf16, got ", dtype_name(c_dtype));
  const bool bf16 = c_dtype == DType::bf16;
  require_sm90a_kernels("grouped GEMM dW (wgmma)");
  double* warp_sums = squares == nullptr ? nullptr
                                         : reinterpret_cast<double*>(static_cast<char*>(squares->scratch) +
                                                                     kSumOfSquaresWorkspaceBytes);
  const double divisor = squares == nullptr ? 1.0 : squares->divisor;
  const WeightGradParams params{a,
                                b,
                                c,
                                offsets,
                                num_groups,
                                m,
                                n,
                                (m + kBlockM - 1) / kBlockM,
                                (n + kBlockN - 1) / kBlockN,
                                warp_sums,
                                1.0 / (divisor * divisor)};
  const int64_t tiles = static_cast<int64_t>(num_groups) * params.m_tiles * params.n_tiles;
  CHECK(tiles < (int64_t{1} << 31), "grouped GEMM dW (wgmma): ", tiles, " tiles overflow 32-bit tile indices");
  int device = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t most_blocks = squares == nullptr ? sms : std::min(sms, kMaxSquaresBlocks);
  const auto grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(tiles, most_blocks)));
  // a [R, M] and b [R, N] as 2D maps of 64 x 64 boxes. R lives on the device only: the maps claim
  // 2^31 - 1 rows, and the kernel loads by TMA only k-blocks wholly inside a group (so inside the
  // tensors); each group's partial last k-block goes by cp.async.
  const cuuint32_t box[2] = {64, kBlockK};
  const cuuint64_t rows = (cuuint64_t{1} << 31) - 1;
  const cuuint64_t a_dims[2] = {static_cast<cuuint64_t>(m), rows}, a_strides[1] = {static_cast<cuuint64_t>(m) * 2};
  const cuuint64_t b_dims[2] = {static_cast<cuuint64_t>(n), rows}, b_strides[1] = {static_cast<cuuint64_t>(n) * 2};
  const CUtensorMap map_a = bf16_tensor_map(a, 2, a_dims, a_strides, box);
  const CUtensorMap map_b = bf16_tensor_map(b, 2, b_dims, b_strides, box);
  // c [G, M, N] as a 3D map (N, M, G) of 128-byte-wide boxes, 64 rows high: f32 32 x 64, bf16
  // 64 x 64 (one staging part). What a box holds past M or N is not stored.
  const cuuint64_t element_bytes = bf16 ? 2 : 4;
  const cuuint64_t c_dims[3] = {static_cast<cuuint64_t>(n), static_cast<cuuint64_t>(m),
                                static_cast<cuuint64_t>(num_groups)};
  const cuuint64_t c_strides[2] = {static_cast<cuuint64_t>(n) * element_bytes,
                                   static_cast<cuuint64_t>(m) * n * element_bytes};
  const cuuint32_t c_box[3] = {static_cast<cuuint32_t>(bf16 ? kWeightGradStagingCols : kWeightGradStoreBoxCols), 64, 1};
  const CUtensorMap map_c =
      bf16 ? bf16_tensor_map(c, 3, c_dims, c_strides, c_box) : f32_tensor_map(c, 3, c_dims, c_strides, c_box);
  if (squares == nullptr) {
    if (bf16)
      launch_weight_grad<nvbf16, false>(map_a, map_b, map_c, params, grid, stream);
    else
      launch_weight_grad<float, false>(map_a, map_b, map_c, params, grid, stream);
    return;
  }
  if (bf16)
    launch_weight_grad<nvbf16, true>(map_a, map_b, map_c, params, grid, stream);
  else
    launch_weight_grad<float, true>(map_a, map_b, map_c, params, grid, stream);
  // The blocks' warp sums, added in order.
  sum_of_squares_cuda(nullptr, 0, warp_sums, static_cast<int64_t>(grid) * kConsumers * 4, divisor, squares->sum,
                      squares->scratch, stream);
}

}  // namespace deltamoe::grouped_gemm_detail
