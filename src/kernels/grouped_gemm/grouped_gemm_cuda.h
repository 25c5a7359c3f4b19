// CUDA grouped products over device-side group offsets (no host synchronisation): bf16 operands,
// fp32 accumulation on the tensor cores (where extents are multiples of 8 and operands 16-byte
// aligned: wgmma on sm_90a for the row products (TMA-fed) and written dW (cp.async-fed), mma.sync
// otherwise; else WMMA). The spec is grouped_gemm.h. Own kernels rather than
// cublasGemmGroupedBatchedEx, which takes group sizes on the host (a sync per layer to read the
// routing counts) and measured at 34-42% of dense.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "kernels/common/sum_of_squares_cuda.h"
#include "kernels/moe_experts/moe_experts_sizes.h"

namespace deltamoe {

// Rows per tile of the row-grouped product: every group wastes at most one partial tile.
constexpr int kGroupedGemmTileRows = 128;

// Workspace of grouped_gemm_rows_cuda: grouped_gemm_rows_workspace_bytes (the per-group tile
// prefix, int32 [G+1]; kernels/moe_experts/moe_experts_sizes.h, host arithmetic for the planners).

// The row-grouped product of grouped_gemm.h on the device. offsets int32 [G+1] is read on the
// device only; max_rows (>= offsets[G], e.g. T*K) sizes the launch, which covers
// ceil(max_rows / 128) + G row tiles; tiles past a group's end exit at once. a must hold max_rows
// readable rows (the sm_90a kernel loads whole 128-row boxes; rows past offsets[G] are never used).
// c [R, N] written as bf16 or f32 (c_dtype). Rows past offsets[G] are not written.
void grouped_gemm_rows_cuda(const __nv_bfloat16* a, const __nv_bfloat16* b, bool b_stored_nk, void* c, DType c_dtype,
                            const int32_t* offsets, int64_t num_groups, int64_t max_rows, int64_t n, int64_t k,
                            void* workspace, size_t workspace_bytes, cudaStream_t stream);

// What the weight-gradient product does with c. added_to: c_g += a_g^T b_g, the reference's
// contract (a parameter gradient collects every product into it); groups without rows leave c_g
// unchanged. written: c_g = a_g^T b_g, zeros for groups without rows; c is not read, so the first
// product into a gradient needs neither a zeroing pass nor the read of c (half of dW's f32 traffic).
enum class WeightGradOutput { added_to, written };

// The sum of squares of a written weight gradient as the optimizer's gradient norm counts it:
// *sum = sum over c's elements of (c / divisor)^2 in fp64, deterministic (the same bits every call).
// The other kernels sum c after the product (sum_of_squares_cuda.h: fl32(fl64(c) / divisor)^2). The
// sm_90a "written" kernel forms it from the products' registers as it stores them, so the norm need
// not read c back (4 bytes per parameter): the undivided squares, their total times 1 / divisor^2,
// within kWrittenSquaresRelError (f32 c) or kWrittenSquaresRelErrorBf16 of the other form (which
// rounds each quotient to fp32).
// With bf16 c the sum is over the stored values, i.e. each product rounded to bf16 and widened back
// (exactly) to fp32, in both forms: what the optimizer reads is the stored c.
// scratch: kWeightGradSquaresScratchBytes of device memory.
// f32 c: |fl32(q)^2 - q^2| <= (2 u + u^2) q^2 with u = 2^-24, and fp64's roundings: rounded up.
constexpr double kWrittenSquaresRelError = 1.5e-7;
// bf16 c: the epilogue sums 16 squares (each exact in fp32) in fp32 at most four roundings deep
// (nonnegative terms: within 4 u of their sum), the other form's quotients 2 u + u^2: 6 u, rounded up.
constexpr double kWrittenSquaresRelErrorBf16 = 4e-7;
struct WeightGradSquares {
  double* sum = nullptr;
  double divisor = 1.0;
  void* scratch = nullptr;
};
// The reduction's partials, then one fp64 sum per consumer warp of at most 256 dW blocks.
constexpr size_t kWeightGradSquaresScratchBytes = kSumOfSquaresWorkspaceBytes + 256 * 8 * sizeof(double);

// The weight-gradient product of grouped_gemm.h: c [G, M, N], added to or written (output);
// each element is owned by one block (no atomics, deterministic). squares (written only; null:
// none) also sets *squares->sum, above.
// c_dtype: f32, or bf16 (the routed experts' gradients, half the bytes to store and to read back):
// the product is accumulated in fp32 either way; bf16 written stores c = bf16_rn(product), bf16
// added to stores c = bf16_rn(float(c) + product) (one fp32 add, one rounding per call).
void grouped_gemm_weight_grad_cuda(const __nv_bfloat16* a, const __nv_bfloat16* b, void* c, DType c_dtype,
                                   const int32_t* offsets, int64_t num_groups, int64_t m, int64_t n,
                                   WeightGradOutput output, cudaStream_t stream,
                                   const WeightGradSquares* squares = nullptr);

}  // namespace deltamoe
