// cuBLASLt products in row-major terms: a row-major [r, c] matrix is cuBLASLt's column-major
// [c, r], so C = op(A) op(B) is issued as C^T = op(B)^T op(A)^T with the operands swapped.
#include "kernels/gemm/gemm_cuda.h"

#include <algorithm>
#include <atomic>
#include <optional>

#include "core/cuda_check.h"
#include "core/device_alloc.h"
#include "core/error.h"

namespace deltamoe {

namespace {

// Largest power of two (up to 256) dividing the base address and the row stride in bytes:
// cuBLASLt picks kernels by the alignment it is promised, so promise only what is true.
int alignment_bytes(const void* ptr, int64_t ld, size_t element_size) {
  uint64_t bits = reinterpret_cast<uintptr_t>(ptr) | static_cast<uint64_t>(ld) * element_size | 256u;
  return static_cast<int>(bits & (~bits + 1));
}

cudaDataType_t cuda_type_of(DType dtype) {
  if (dtype == DType::bf16) return CUDA_R_16BF;
  CHECK(dtype == DType::f32, "gemm: output dtype must be bf16 or f32, not ", dtype_name(dtype));
  return CUDA_R_32F;
}

// RAII holders so that an error thrown mid-call leaks no descriptors.
struct MatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  ~MatmulDesc() {
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};
struct MatrixLayout {
  cublasLtMatrixLayout_t layout = nullptr;
  ~MatrixLayout() {
    if (layout) cublasLtMatrixLayoutDestroy(layout);
  }
};

}  // namespace

namespace {
std::atomic<int64_t> g_heuristic_queries{0};
}  // namespace

int64_t GemmContext::heuristic_queries() { return g_heuristic_queries.load(std::memory_order_relaxed); }

GemmContext::GemmContext(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  CUBLAS_CHECK(cublasLtCreate(&handle_));
  if (workspace_bytes_ > 0) workspace_ = device_malloc(workspace_bytes_, "gemm: cuBLASLt workspace");
}

GemmContext::~GemmContext() {
  if (workspace_ != nullptr) cudaFree(workspace_);  // NOTE: unchecked in a destructor on purpose
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

namespace {

// The class of a problem: what a new token count leaves unchanged (m and k set to 0).
GemmContext::Key class_of(const GemmContext::Key& key) {
  GemmContext::Key out = key;
  out.m = out.k = 0;
  return out;
}

// Column-major layouts of the stored matrices of a problem (cuBLASLt's A is our B, its B our A).
struct ProblemLayouts {
  MatrixLayout a, b, c;
  explicit ProblemLayouts(const GemmContext::Key& key) {
    const int64_t m = key.m, n = key.n, k = key.k;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a.layout, CUDA_R_16BF, key.trans_b ? k : n, key.trans_b ? n : k,
                                            key.ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b.layout, CUDA_R_16BF, key.trans_a ? m : k, key.trans_a ? k : m,
                                            key.lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c.layout, cuda_type_of(key.out_dtype), n, m, key.ldc));
  }
};

// The token count of a problem: the rows of the activations, m, or k in a weight-gradient product
// (trans_a: A stored [tokens, m]).
int64_t token_count(const GemmContext::Key& key) { return key.trans_a ? key.k : key.m; }

// The bucket of a token count: the smallest kGemmBucketRows[b] >= it (the last above them all).
int bucket_of(int64_t tokens) {
  for (int b = 0; b < kGemmNumBuckets; ++b)
    if (tokens <= kGemmBucketRows[b]) return b;
  return kGemmNumBuckets - 1;
}

// The problem whose algorithm bucket b of a class uses: the token count set to the bucket's rows.
// A row stride the count would outgrow (B stored [N, K] with K the tokens) grows with it; the
// matrices are never read.
GemmContext::Key bucket_problem(const GemmContext::Key& key, int b) {
  GemmContext::Key out = key;
  const int64_t rows = kGemmBucketRows[b];
  if (key.trans_a) {
    out.k = rows;
    if (key.trans_b) out.ldb = std::max(key.ldb, rows);
  } else {
    out.m = rows;
  }
  return out;
}

}  // namespace

bool GemmContext::query_heuristic(const Key& key, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                                  cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatmulAlgo_t* algo,
                                  bool errors_mean_none) {
  g_heuristic_queries.fetch_add(1, std::memory_order_relaxed);
  cublasLtMatmulPreference_t preference = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  cublasLtMatmulHeuristicResult_t result{};
  int num_results = 0;
  // cuBLASLt's A/B are our B/A (operands swapped for row-major), so their alignments swap too.
  uint32_t align_lt_a = static_cast<uint32_t>(key.alignment_b), align_lt_b = static_cast<uint32_t>(key.alignment_a);
  uint32_t align_c = static_cast<uint32_t>(key.alignment_c);
  cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_, sizeof(workspace_bytes_));
  if (status == CUBLAS_STATUS_SUCCESS)
    status = cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                  &align_lt_a, sizeof(align_lt_a));
  if (status == CUBLAS_STATUS_SUCCESS)
    status = cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                  &align_lt_b, sizeof(align_lt_b));
  if (status == CUBLAS_STATUS_SUCCESS)
    status = cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                                  sizeof(align_c));
  if (status == CUBLAS_STATUS_SUCCESS)
    status = cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c,
                                                  sizeof(align_c));
  // Split-K partial sums only in fp32: the OUTPUT_TYPE and INPLACE schemes add the parts in the
  // output type, i.e. round a bf16 product more than once (measured: up to a whole bf16 step on
  // small products, where the heuristic splits K).
  uint32_t reduction_schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  if (status == CUBLAS_STATUS_SUCCESS)
    status = cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                  &reduction_schemes, sizeof(reduction_schemes));
  if (status == CUBLAS_STATUS_SUCCESS)
    status = cublasLtMatmulAlgoGetHeuristic(handle_, op, a, b, c, c, preference, 1, &result, &num_results);
  cublasLtMatmulPreferenceDestroy(preference);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || (errors_mean_none && status != CUBLAS_STATUS_SUCCESS)) return false;
  CUBLAS_CHECK(status);
  if (num_results <= 0) return false;
  *algo = result.algo;
  return true;
}

const cublasLtMatmulAlgo_t& GemmContext::algorithm_for(const Key& key, cublasLtMatmulDesc_t op,
                                                       cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                                       cublasLtMatrixLayout_t c) {
  auto found = algorithms_.find(key);
  if (found != algorithms_.end()) return found->second;
  // The class's algorithms: the heuristic's for the class at each bucket's token count, all asked
  // when the class is first met, whatever token count came first, so that the kernel a product runs
  // (and its bits) depends on the problem alone, never on the shapes the context saw before: a run
  // resumed from a checkpoint computes what the uninterrupted one did.
  const Key class_key = class_of(key);
  auto same_class = algorithm_classes_.find(class_key);
  if (same_class == algorithm_classes_.end()) {
    BucketAlgorithms buckets;
    for (int b = 0; b < kGemmNumBuckets; ++b) {
      const Key problem = bucket_problem(key, b);
      const ProblemLayouts layouts(problem);
      cublasLtMatmulAlgo_t algo{};
      // (An error there only means that bucket has no algorithm: its token counts ask for their own.)
      if (query_heuristic(problem, op, layouts.a.layout, layouts.b.layout, layouts.c.layout, &algo,
                          /*errors_mean_none=*/true))
        buckets[static_cast<size_t>(b)] = algo;
    }
    same_class = algorithm_classes_.emplace(class_key, buckets).first;
  }
  const std::optional<cublasLtMatmulAlgo_t>& bucket =
      same_class->second[static_cast<size_t>(bucket_of(token_count(key)))];
  if (bucket.has_value()) {
    // The bucket's algorithm at this token count, if cuBLASLt accepts it here.
    cublasLtMatmulHeuristicResult_t checked{};
    if (cublasLtMatmulAlgoCheck(handle_, op, a, b, c, c, &*bucket, &checked) == CUBLAS_STATUS_SUCCESS &&
        checked.workspaceSize <= workspace_bytes_) {
      return algorithms_.emplace(key, *bucket).first->second;
    }
  }
  // Not accepted (or no algorithm for the bucket): this problem's own, a function of the problem too.
  cublasLtMatmulAlgo_t algo{};
  CHECK(query_heuristic(key, op, a, b, c, &algo), "gemm: cuBLASLt has no algorithm for a ", key.m, "x", key.n, "x",
        key.k, " bf16 product (trans_a ", key.trans_a, ", trans_b ", key.trans_b, ", output ",
        dtype_name(key.out_dtype), ")");
  return algorithms_.emplace(key, algo).first->second;
}

namespace {

// The product of gemm_bf16_cuda, with bias [n] bf16 (non-null) added per output column in the
// epilogue, to the fp32 accumulator before the one rounding to C's type.
void gemm_with_epilogue(GemmContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                        const __nv_bfloat16* a, int64_t lda, const __nv_bfloat16* b, int64_t ldb, float beta, void* c,
                        DType c_dtype, int64_t ldc, const __nv_bfloat16* bias, cudaStream_t stream) {
  CHECK(m >= 0 && n >= 0 && k >= 0, "gemm: negative size ", m, "x", n, "x", k);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    // An empty sum: C = beta * C. Only beta = 1 (accumulating into a gradient) needs no work.
    CHECK(beta == 1.0f, "gemm: inner size 0 with beta ", beta, " is not supported");
    return;
  }
  // Row strides must cover a row of each operand as stored.
  CHECK(lda >= (trans_a ? m : k), "gemm: lda ", lda, " is shorter than a row of A");
  CHECK(ldb >= (trans_b ? k : n), "gemm: ldb ", ldb, " is shorter than a row of B");
  CHECK(ldc >= n, "gemm: ldc ", ldc, " is shorter than a row of C (", n, ")");
  CHECK(a != nullptr && b != nullptr && c != nullptr, "gemm: null operand");

  MatmulDesc op;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&op.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // cuBLASLt computes C^T [n, m] = opL(B_lt) opL(A_lt) with A_lt = our B, B_lt = our A.
  // Our B stored [K, N] row-major is column-major [N, K] = op(B)^T already: no transpose.
  const cublasOperation_t op_lt_a = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_lt_b = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_lt_a, sizeof(op_lt_a)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_lt_b, sizeof(op_lt_b)));
  if (bias != nullptr) {
    // cuBLASLt's D is our C^T: its rows are our columns, so a per-row bias is our per-column one.
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = CUDA_R_16BF;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  }

  GemmContext::Key key{trans_a,
                       trans_b,
                       m,
                       n,
                       k,
                       lda,
                       ldb,
                       ldc,
                       c_dtype,
                       alignment_bytes(a, lda, sizeof(__nv_bfloat16)),
                       alignment_bytes(b, ldb, sizeof(__nv_bfloat16)),
                       alignment_bytes(c, ldc, dtype_size(c_dtype)),
                       bias != nullptr ? alignment_bytes(bias, 0, sizeof(__nv_bfloat16)) : 0};
  const ProblemLayouts layouts(key);
  const cublasLtMatmulAlgo_t& algo =
      ctx.algorithm_for(key, op.desc, layouts.a.layout, layouts.b.layout, layouts.c.layout);
  CUBLAS_CHECK(cublasLtMatmul(ctx.handle(), op.desc, &alpha, b, layouts.a.layout, a, layouts.b.layout, &beta, c,
                              layouts.c.layout, c, layouts.c.layout, &algo, ctx.workspace(), ctx.workspace_bytes(),
                              stream));
}

}  // namespace

void gemm_bf16_cuda(GemmContext& ctx, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const __nv_bfloat16* a, int64_t lda, const __nv_bfloat16* b, int64_t ldb, float beta, void* c,
                    DType c_dtype, int64_t ldc, cudaStream_t stream) {
  gemm_with_epilogue(ctx, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, c_dtype, ldc, nullptr, stream);
}

void linear_forward_cuda(GemmContext& ctx, const __nv_bfloat16* x, const __nv_bfloat16* weight, void* y,
                         DType y_dtype, int64_t rows, int64_t in_features, int64_t out_features, cudaStream_t stream) {
  // y [T, N] = x [T, K] . (W [N, K])^T
  gemm_bf16_cuda(ctx, false, true, rows, out_features, in_features, 1.0f, x, in_features, weight, in_features, 0.0f, y,
                 y_dtype, out_features, stream);
}

void linear_forward_bias_cuda(GemmContext& ctx, const __nv_bfloat16* x, const __nv_bfloat16* weight,
                              const __nv_bfloat16* bias, __nv_bfloat16* y, int64_t rows, int64_t in_features,
                              int64_t out_features, cudaStream_t stream) {
  CHECK(bias != nullptr, "linear_forward_bias_cuda: null bias");
  CHECK(in_features > 0, "linear_forward_bias_cuda: in_features must be positive");
  gemm_with_epilogue(ctx, false, true, rows, out_features, in_features, 1.0f, x, in_features, weight, in_features,
                     0.0f, y, DType::bf16, out_features, bias, stream);
}

void linear_backward_input_cuda(GemmContext& ctx, const __nv_bfloat16* dy, const __nv_bfloat16* weight,
                                __nv_bfloat16* dx, int64_t rows, int64_t in_features, int64_t out_features,
                                cudaStream_t stream) {
  // dx [T, K] = dy [T, N] . W [N, K]
  gemm_bf16_cuda(ctx, false, false, rows, in_features, out_features, 1.0f, dy, out_features, weight, in_features, 0.0f,
                 dx, DType::bf16, in_features, stream);
}

void linear_backward_input_f32_cuda(GemmContext& ctx, const __nv_bfloat16* dy, const __nv_bfloat16* weight,
                                    float* dx, bool accumulate, int64_t rows, int64_t in_features,
                                    int64_t out_features, cudaStream_t stream) {
  // dx [T, K] (+)= dy [T, N] . W [N, K]
  gemm_bf16_cuda(ctx, false, false, rows, in_features, out_features, 1.0f, dy, out_features, weight, in_features,
                 accumulate ? 1.0f : 0.0f, dx, DType::f32, in_features, stream);
}

void linear_backward_weight_cuda(GemmContext& ctx, const __nv_bfloat16* dy, const __nv_bfloat16* x, float* d_weight,
                                 int64_t rows, int64_t in_features, int64_t out_features, cudaStream_t stream) {
  // dW [N, K] += (dy [T, N])^T . x [T, K]
  gemm_bf16_cuda(ctx, true, false, out_features, in_features, rows, 1.0f, dy, out_features, x, in_features, 1.0f,
                 d_weight, DType::f32, in_features, stream);
}

void linear_backward_weight_written_cuda(GemmContext& ctx, const __nv_bfloat16* dy, const __nv_bfloat16* x,
                                         float* d_weight, int64_t rows, int64_t in_features, int64_t out_features,
                                         cudaStream_t stream) {
  // dW [N, K] = (dy [T, N])^T . x [T, K]
  gemm_bf16_cuda(ctx, true, false, out_features, in_features, rows, 1.0f, dy, out_features, x, in_features, 0.0f,
                 d_weight, DType::f32, in_features, stream);
}

}  // namespace deltamoe
