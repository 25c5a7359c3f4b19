// The grouped GEMM's kernel families behind grouped_gemm_cuda.h: the Hopper wgmma + TMA kernel
// (grouped_gemm_wgmma.cu, row products and written dW on sm_90a), the portable mma.sync kernel
// (grouped_gemm_mma.cu, taken where its alignment rules hold) and the WMMA kernel
// (grouped_gemm.cu, any shape). Tests and benchmarks pick one explicitly; callers use the public header.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "kernels/grouped_gemm/grouped_gemm_cuda.h"

namespace deltamoe {

// automatic: where the sm_90a kernels may run (kernels/common/kernel_path_cuda.h: an sm_90 GPU
// running sm_90a code), the wgmma kernels (row products; dW written) where the mma.sync alignment
// rules hold; otherwise the mma.sync kernel where they hold, with the block tile chosen in
// grouped_gemm.cu per product kind, else WMMA. wmma: always the WMMA kernel (the fallback).
// mma_128x128 / mma_128x256: the mma.sync kernel (the sm_80 path) with that block tile where it
// applies, else WMMA. wgmma: as automatic on the sm_90a path, an error on the sm_80 path.
// dW "added to" runs on mma.sync on both paths; the kernels without a "written" epilogue
// (mma.sync, WMMA) write by zeroing c first and then adding to it. Every kernel takes dW's c in
// f32 or bf16.
enum class GroupedGemmKernel { automatic, wmma, mma_128x128, mma_128x256, wgmma };

// grouped_gemm_rows_cuda / grouped_gemm_weight_grad_cuda with the kernel chosen by the caller.
void grouped_gemm_rows_cuda_with(GroupedGemmKernel kernel, const __nv_bfloat16* a, const __nv_bfloat16* b,
                                 bool b_stored_nk, void* c, DType c_dtype, const int32_t* offsets, int64_t num_groups,
                                 int64_t max_rows, int64_t n, int64_t k, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream);
void grouped_gemm_weight_grad_cuda_with(GroupedGemmKernel kernel, const __nv_bfloat16* a, const __nv_bfloat16* b,
                                        void* c, DType c_dtype, const int32_t* offsets, int64_t num_groups, int64_t m,
                                        int64_t n, WeightGradOutput output, cudaStream_t stream,
                                        const WeightGradSquares* squares = nullptr);

namespace grouped_gemm_detail {

// Block tiles of the mma.sync kernel: square 128x128 (two blocks per SM) or wide 128x256 (one block
// per SM, half the shared-memory reads per product).
enum class MmaTile { square, wide };

// Whether a device pointer allows 16-byte vector accesses (both kernels' fast copies need it).
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The mma.sync kernel needs every contiguous extent a multiple of 8 bf16 (16-byte chunks wholly
// inside or outside) and 16-byte aligned bases; sizes were validated by the public launcher.
bool mma_applies(const void* a, const void* b, const void* c, int64_t contiguous_1, int64_t contiguous_2);

// Row-grouped product with the mma.sync kernel. tile_starts int32 [G+1]: per-group prefix of
// 128-row tiles (built on the device by the caller); max_rows bounds offsets[G] (sizes the grid).
void rows_mma(MmaTile tile, const __nv_bfloat16* a, const __nv_bfloat16* b, bool b_stored_nk, void* c, DType c_dtype,
              const int32_t* offsets, const int32_t* tile_starts, int num_groups, int64_t max_rows, int n, int k,
              cudaStream_t stream);

// Weight-gradient product (c [G, M, N] f32 or bf16, added to) with the mma.sync kernel.
void weight_grad_mma(MmaTile tile, const __nv_bfloat16* a, const __nv_bfloat16* b, void* c, DType c_dtype,
                     const int32_t* offsets, int num_groups, int m, int n, cudaStream_t stream);

// Whether the current device runs the wgmma kernel: sm90a_kernels_usable() (kernel_path_cuda.h).
bool wgmma_available();

// Row-grouped product with the wgmma kernel (needs wgmma_available() and mma_applies). a holds
// max_rows readable rows: rows past offsets[G] may be loaded, never used.
void rows_wgmma(const __nv_bfloat16* a, const __nv_bfloat16* b, bool b_stored_nk, void* c, DType c_dtype,
                const int32_t* offsets, const int32_t* tile_starts, int num_groups, int64_t max_rows, int n, int k,
                cudaStream_t stream);

// Weight-gradient product, c (f32 or bf16) written, with the wgmma kernel (needs wgmma_available()
// and mma_applies); squares (null: none) summed from the stored values in registers (bf16: after
// the rounding), one fp64 sum per consumer warp into squares->scratch past the reduction's
// partials, then added up into *squares->sum.
void weight_grad_written_wgmma(const __nv_bfloat16* a, const __nv_bfloat16* b, void* c, DType c_dtype,
                               const int32_t* offsets, int num_groups, int m, int n, cudaStream_t stream,
                               const WeightGradSquares* squares = nullptr);

}  // namespace grouped_gemm_detail
}  // namespace deltamoe
