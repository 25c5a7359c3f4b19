// cuBLASLt wrapper for the dense products of training: bf16 x bf16 with fp32 accumulation into a
// bf16 or fp32 output, in row-major terms, plus the three products of a linear layer
// (y = x W^T (+ bias), dX = dY W, dW += dY^T X). One GemmContext (handle, workspace, chosen algorithms).
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <tuple>

#include "core/dtype.h"

namespace deltamoe {

// cuBLAS recommends 32 MiB of workspace on Hopper.
constexpr size_t kGemmDefaultWorkspaceBytes = size_t{32} << 20;

// Token-count buckets of a class of products (see GemmContext): powers of two from 64 to 32,768
// rows; a count takes the smallest bucket that holds it (the largest above them all).
constexpr int kGemmNumBuckets = 10;
constexpr int64_t kGemmBucketRows[kGemmNumBuckets] = {64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768};

// Owns the cuBLASLt handle and its workspace (allocated once, here, never in a step) and caches
// the algorithm per problem (shape, strides, alignment). Products that differ only in their token
// count (m, or k in a weight gradient: the rows of a packed micro-batch) form a class. When a class
// is first met, the heuristic is asked for it at every bucket's token count; a token count then
// runs its bucket's algorithm once cublasLtMatmulAlgoCheck accepts it there (else asks the
// heuristic for its own). So micro-batches of new lengths run kernels already loaded and ask
// nothing, each runs an algorithm chosen for a size within 2x of its own, and which kernel a
// product runs depends on the product alone, not on the shapes seen before it: a resumed run
// computes the same bits as the uninterrupted one.
// Use one context per stream: the workspace is shared by every product issued through it. Not
// thread-safe.
class GemmContext {
 public:
  explicit GemmContext(size_t workspace_bytes = kGemmDefaultWorkspaceBytes);
  ~GemmContext();
  GemmContext(const GemmContext&) = delete;
  GemmContext& operator=(const GemmContext&) = delete;

  cublasLtHandle_t handle() const { return handle_; }
  void* workspace() const { return workspace_; }
  size_t workspace_bytes() const { return workspace_bytes_; }
  // Number of distinct problems the heuristic has been asked about (for tests and logs).
  size_t num_cached_algorithms() const { return algorithms_.size(); }
  // Heuristic queries of every context of the process (`bench` shows that steps after the first
  // make none: a new token count runs its class's algorithm, and asks only where
  // cublasLtMatmulAlgoCheck refuses that algorithm at the new count).
  static int64_t heuristic_queries();

  // Internal: the algorithm for a problem key, queried on first use.
  struct Key {
    bool trans_a, trans_b;
    int64_t m, n, k, lda, ldb, ldc;
    DType out_dtype;
    int alignment_a, alignment_b, alignment_c;
    int bias_alignment;  // 0: no bias epilogue
    auto tie() const {
      return std::tie(trans_a, trans_b, m, n, k, lda, ldb, ldc, out_dtype, alignment_a, alignment_b, alignment_c,
                      bias_alignment);
    }
    bool operator<(const Key& other) const { return tie() < other.tie(); }
  };
  const cublasLtMatmulAlgo_t& algorithm_for(const Key& key, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                                            cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c);

 private:
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, cublasLtMatmulAlgo_t> algorithms_;
  // Per class (the problem with m and k set to 0): the heuristic's algorithm for it at each
  // bucket's token count (none where it had none).
  using BucketAlgorithms = std::array<std::optional<cublasLtMatmulAlgo_t>, kGemmNumBuckets>;
  std::map<Key, BucketAlgorithms> algorithm_classes_;
  // The heuristic's first algorithm for a problem with these layouts; false when it has none (or,
  // with errors_mean_none, when cuBLASLt reports any error instead of throwing it).
  bool query_heuristic(const Key& key, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                       cublasLtMatrixLayout_t c, cublasLtMatmulAlgo_t* algo, bool errors_mean_none = false);
};

// Row-major C [M, N] = alpha * op(A) op(B) + beta * C, bf16 operands, fp32 accumulation.
// op(A) is [M, K]: A is stored [M, K] (trans_a false) or [K, M] (trans_a true), row stride lda.
// op(B) is [K, N]: B is stored [K, N] (trans_b false) or [N, K] (trans_b true), row stride ldb.
// C is bf16 or f32 (c_dtype) with row stride ldc; with beta = 0 C is written, never read.
void gemm_bf16_cuda(GemmContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const __nv_bfloat16* a, int64_t lda, const __nv_bfloat16* b, int64_t ldb, float beta, void* c,
                    DType c_dtype, int64_t ldc, cudaStream_t stream);

// Linear layer products. Legend: T rows, K in features, N out features; all contiguous.
// x [T, K] bf16, weight [N, K] bf16 -> y [T, N] written, bf16 or f32 (y_dtype).
void linear_forward_cuda(GemmContext& ctx, const __nv_bfloat16* x, const __nv_bfloat16* weight, void* y,
                         DType y_dtype, int64_t rows, int64_t in_features, int64_t out_features, cudaStream_t stream);
// The same with a bias [N] bf16 added in the epilogue: y = bf16(x W^T + bias), one rounding of the
// fp32 accumulator, as cuBLAS's bias epilogue does for transformers' linear layers under autocast.
// (A bf16 product and then a bf16 bias add would round twice.)
void linear_forward_bias_cuda(GemmContext& ctx, const __nv_bfloat16* x, const __nv_bfloat16* weight,
                              const __nv_bfloat16* bias, __nv_bfloat16* y, int64_t rows, int64_t in_features,
                              int64_t out_features, cudaStream_t stream);
// dy [T, N] bf16, weight [N, K] -> dx [T, K] bf16 written.
void linear_backward_input_cuda(GemmContext& ctx, const __nv_bfloat16* dy, const __nv_bfloat16* weight,
                                __nv_bfloat16* dx, int64_t rows, int64_t in_features, int64_t out_features,
                                cudaStream_t stream);
// dy [T, N] bf16, weight [N, K] -> dx [T, K] f32, the fp32 accumulator unrounded: written, or added
// to when `accumulate` (a block summing its projections' input gradients in fp32).
void linear_backward_input_f32_cuda(GemmContext& ctx, const __nv_bfloat16* dy, const __nv_bfloat16* weight,
                                    float* dx, bool accumulate, int64_t rows, int64_t in_features,
                                    int64_t out_features, cudaStream_t stream);
// dy [T, N] bf16, x [T, K] bf16 -> d_weight [N, K] f32 added to (beta = 1).
void linear_backward_weight_cuda(GemmContext& ctx, const __nv_bfloat16* dy, const __nv_bfloat16* x, float* d_weight,
                                 int64_t rows, int64_t in_features, int64_t out_features, cudaStream_t stream);
// The same with d_weight written (beta = 0, its old values never read): a gradient whose first
// product of the step needs no zeroing pass before it.
void linear_backward_weight_written_cuda(GemmContext& ctx, const __nv_bfloat16* dy, const __nv_bfloat16* x,
                                         float* d_weight, int64_t rows, int64_t in_features, int64_t out_features,
                                         cudaStream_t stream);

}  // namespace deltamoe
