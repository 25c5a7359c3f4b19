// Dense LoRA products (lora_cuda.h) as five small cuBLASLt GEMMs around the base one; with LoRA
// dropout the adapter reads x' = dropout(x) from the pass's scratch and its input gradient goes
// through the mask on its way into dx.
#include "core/error.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/lora/lora_cuda.h"

namespace deltamoe {

namespace {

void check_adapter(const LoraDeviceAdapter& adapter, const char* where) {
  CHECK(adapter.a != nullptr && adapter.b != nullptr, where, ": the adapter has no A or B");
  CHECK(adapter.rank > 0, where, ": adapter rank ", adapter.rank);
  CHECK((adapter.grad_a == nullptr) == (adapter.grad_b == nullptr), where,
        ": an adapter is trained whole (A and B) or frozen whole");
}

// The active dropout of a call, or null; checks its scratch.
const LoraDropoutPass* active_dropout(const LoraDropoutPass* dropout, int64_t rows, int64_t in_features,
                                      const char* where) {
  if (dropout == nullptr || !dropout->mask.active()) return nullptr;
  CHECK(dropout->scratch != nullptr && dropout->scratch_bytes >= lora_dropout_scratch_bytes(rows, in_features), where,
        ": LoRA dropout needs ", lora_dropout_scratch_bytes(rows, in_features), " bytes of scratch, got ",
        dropout->scratch_bytes);
  return dropout;
}

}  // namespace

void lora_linear_forward_cuda(GemmContext& gemm, const __nv_bfloat16* x, const LoraDeviceAdapter& adapter,
                              __nv_bfloat16* xa, void* y, DType y_dtype, int64_t rows, int64_t in_features,
                              int64_t out_features, cudaStream_t stream, const LoraDropoutPass* dropout) {
  check_adapter(adapter, "lora_linear_forward_cuda");
  if (rows == 0) return;
  const int64_t r = adapter.rank;
  if (const LoraDropoutPass* d = active_dropout(dropout, rows, in_features, "lora_linear_forward_cuda")) {
    auto* x_dropped = static_cast<__nv_bfloat16*>(d->scratch);
    lora_dropout_apply_cuda(d->mask, x, x_dropped, rows, in_features, stream);
    x = x_dropped;
  }
  linear_forward_cuda(gemm, x, adapter.a, xa, DType::bf16, rows, in_features, r, stream);
  // y [T, out] += s xa [T, r] B^T (B [out, r] stored [N, K]).
  gemm_bf16_cuda(gemm, false, true, rows, out_features, r, adapter.scaling, xa, r, adapter.b, r, 1.0f, y, y_dtype,
                 out_features, stream);
}

void lora_linear_backward_cuda(GemmContext& gemm, const __nv_bfloat16* x, const __nv_bfloat16* dy,
                               const LoraDeviceAdapter& adapter, __nv_bfloat16* xa, bool recompute_xa,
                               __nv_bfloat16* dxa, void* dx, DType dx_dtype, int64_t rows, int64_t in_features,
                               int64_t out_features, cudaStream_t stream, const LoraDropoutPass* dropout) {
  check_adapter(adapter, "lora_linear_backward_cuda");
  if (rows == 0) return;
  const int64_t r = adapter.rank;
  const bool trained = adapter.grad_a != nullptr;
  if (!trained && dx == nullptr) return;
  const LoraDropoutPass* d = active_dropout(dropout, rows, in_features, "lora_linear_backward_cuda");
  // dxa [T, r] = s dy [T, out] B [out, r].
  gemm_bf16_cuda(gemm, false, false, rows, r, out_features, adapter.scaling, dy, out_features, adapter.b, r, 0.0f, dxa,
                 DType::bf16, r, stream);
  if (trained) {
    if (d != nullptr) {
      // x' again (the forward's mask: same counters), read by xa's recompute and dA.
      auto* x_dropped = static_cast<__nv_bfloat16*>(d->scratch);
      lora_dropout_apply_cuda(d->mask, x, x_dropped, rows, in_features, stream);
      x = x_dropped;
    }
    if (recompute_xa) linear_forward_cuda(gemm, x, adapter.a, xa, DType::bf16, rows, in_features, r, stream);
    // dB [out, r] += s dy^T xa; dA [r, in] += dxa^T x.
    gemm_bf16_cuda(gemm, true, false, out_features, r, rows, adapter.scaling, dy, out_features, xa, r, 1.0f,
                   adapter.grad_b, DType::f32, r, stream);
    gemm_bf16_cuda(gemm, true, false, r, in_features, rows, 1.0f, dxa, r, x, in_features, 1.0f, adapter.grad_a,
                   DType::f32, in_features, stream);
  }
  // dx [T, in] += dxa [T, r] A [r, in]; with dropout through the mask, via fp32 scratch (after dA
  // has read x' there: same stream).
  if (dx != nullptr && d != nullptr) {
    auto* dx_part = static_cast<float*>(d->scratch);
    gemm_bf16_cuda(gemm, false, false, rows, in_features, r, 1.0f, dxa, r, adapter.a, in_features, 0.0f, dx_part,
                   DType::f32, in_features, stream);
    lora_dropout_add_cuda(d->mask, dx_part, dx, dx_dtype, rows, in_features, stream);
  } else if (dx != nullptr) {
    gemm_bf16_cuda(gemm, false, false, rows, in_features, r, 1.0f, dxa, r, adapter.a, in_features, 1.0f, dx, dx_dtype,
                   in_features, stream);
  }
}

}  // namespace deltamoe
