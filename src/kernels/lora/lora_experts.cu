// Routed-expert LoRA products (lora_cuda.h): grouped GEMMs over the expert-major rows with the rank
// as the N or K dimension, plus three small kernels (B into per-expert layout, dB back into PEFT's
// layout, scaled adds).
#include <algorithm>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/grouped_gemm/grouped_gemm_cuda.h"
#include "kernels/lora/lora_cuda.h"

namespace deltamoe {

namespace {

constexpr size_t kAlign = 256;

size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

unsigned grid_for(int64_t count) {
  return static_cast<unsigned>(std::min<int64_t>((count + 255) / 256, int64_t{1} << 16));
}

// The scratch of one call, carved from the caller's workspace in a fixed order.
struct Scratch {
  __nv_bfloat16* b_experts;  // [E, out, r]
  __nv_bfloat16* xa;         // [R, r]
  __nv_bfloat16* dxa;        // [R, r]
  float* wide;               // [R, max(in, out)]
  float* d_b;                // [E, out, r]
  void* tiles;               // grouped GEMM tile prefix
  size_t tiles_bytes;
};

size_t scratch_bytes(const LoraExpertDims& d, Scratch* s, void* base) {
  const int64_t E = d.num_experts, r = d.rank, R = d.max_rows, wide = std::max(d.in_features, d.out_features);
  size_t offset = 0;
  auto carve = [&](size_t bytes) {
    void* p = base == nullptr ? nullptr : static_cast<char*>(base) + offset;
    offset += aligned(bytes);
    return p;
  };
  void* b_experts = carve(sizeof(__nv_bfloat16) * E * d.out_features * r);
  void* xa = carve(sizeof(__nv_bfloat16) * R * r);
  void* dxa = carve(sizeof(__nv_bfloat16) * R * r);
  void* wide_p = carve(sizeof(float) * R * wide);
  void* d_b = carve(sizeof(float) * E * d.out_features * r);
  const size_t tiles_bytes = grouped_gemm_rows_workspace_bytes(E);
  void* tiles = carve(tiles_bytes);
  if (s != nullptr) {
    *s = Scratch{static_cast<__nv_bfloat16*>(b_experts), static_cast<__nv_bfloat16*>(xa),
                 static_cast<__nv_bfloat16*>(dxa), static_cast<float*>(wide_p), static_cast<float*>(d_b), tiles,
                 tiles_bytes};
  }
  return offset;
}

__global__ void gather_b_kernel(const __nv_bfloat16* b, __nv_bfloat16* b_experts, int64_t E, int64_t out, int64_t r) {
  const int64_t count = E * out * r;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t j = i % r, o = (i / r) % out, e = i / (r * out);  // b_experts[e, o, j]
    b_experts[i] = b[o * r * E + j * E + e];
  }
}

__global__ void scatter_add_db_kernel(const float* d_b, float* grad_b, float scaling, int64_t E, int64_t out,
                                      int64_t r) {
  const int64_t count = E * out * r;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t j = i % r, o = (i / r) % out, e = i / (r * out);
    grad_b[o * r * E + j * E + e] += scaling * d_b[i];
  }
}

// out[i] (+)= scaling * in[i] over the first offsets[E] rows of width n (the rows a plan fills).
template <typename Out>
__global__ void add_scaled_rows_kernel(const float* in, Out* out, float scaling, const int32_t* offsets,
                                       int64_t num_experts, int64_t n, bool add) {
  const int64_t count = static_cast<int64_t>(offsets[num_experts]) * n;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    const float value = scaling * in[i] + (add ? static_cast<float>(out[i]) : 0.0f);
    out[i] = static_cast<Out>(value);
  }
}

template <typename Out>
void add_scaled_rows(const float* in, void* out, float scaling, const int32_t* offsets, const LoraExpertDims& d,
                     int64_t n, bool add, cudaStream_t stream) {
  add_scaled_rows_kernel<Out><<<grid_for(d.max_rows * n), 256, 0, stream>>>(in, static_cast<Out*>(out), scaling,
                                                                            offsets, d.num_experts, n, add);
  CUDA_CHECK_LAUNCH();
}

void add_scaled_rows_any(const float* in, void* out, DType dtype, float scaling, const int32_t* offsets,
                         const LoraExpertDims& d, int64_t n, bool add, cudaStream_t stream) {
  if (dtype == DType::f32) {
    add_scaled_rows<float>(in, out, scaling, offsets, d, n, add, stream);
  } else {
    CHECK(dtype == DType::bf16, "lora experts: output dtype must be bf16 or f32, not ", dtype_name(dtype));
    add_scaled_rows<__nv_bfloat16>(in, out, scaling, offsets, d, n, add, stream);
  }
}

void check_dims(const LoraExpertDims& d, const LoraDeviceAdapter& adapter, size_t workspace_bytes, const char* where) {
  CHECK(d.num_experts > 0 && d.in_features > 0 && d.out_features > 0 && d.rank > 0 && d.max_rows >= 0, where,
        ": bad dims E=", d.num_experts, " in=", d.in_features, " out=", d.out_features, " r=", d.rank);
  CHECK(adapter.a != nullptr && adapter.b != nullptr && adapter.rank == d.rank, where,
        ": the adapter has no A/B or its rank ", adapter.rank, " is not ", d.rank);
  CHECK((adapter.grad_a == nullptr) == (adapter.grad_b == nullptr), where,
        ": an adapter is trained whole (A and B) or frozen whole");
  CHECK(workspace_bytes >= lora_experts_workspace_bytes(d), where, ": workspace of ", workspace_bytes,
        " bytes, need ", lora_experts_workspace_bytes(d));
}

}  // namespace

size_t lora_experts_workspace_bytes(const LoraExpertDims& dims) { return scratch_bytes(dims, nullptr, nullptr); }

void lora_experts_gather_b_cuda(const __nv_bfloat16* b, __nv_bfloat16* b_experts, const LoraExpertDims& d,
                                cudaStream_t stream) {
  gather_b_kernel<<<grid_for(d.num_experts * d.out_features * d.rank), 256, 0, stream>>>(
      b, b_experts, d.num_experts, d.out_features, d.rank);
  CUDA_CHECK_LAUNCH();
}

void lora_experts_forward_cuda(const __nv_bfloat16* xp, const LoraDeviceAdapter& adapter, const int32_t* offsets,
                               void* y, DType y_dtype, const LoraExpertDims& d, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream) {
  check_dims(d, adapter, workspace_bytes, "lora_experts_forward_cuda");
  if (d.max_rows == 0) return;
  Scratch s;
  scratch_bytes(d, &s, workspace);
  lora_experts_gather_b_cuda(adapter.b, s.b_experts, d, stream);
  // xa [R, r] = xp A_e^T (A_e [r, in] stored [N, K]); low [R, out] = xa B_e^T (B_e [out, r] stored [N, K]).
  grouped_gemm_rows_cuda(xp, adapter.a, true, s.xa, DType::bf16, offsets, d.num_experts, d.max_rows, d.rank,
                         d.in_features, s.tiles, s.tiles_bytes, stream);
  grouped_gemm_rows_cuda(s.xa, s.b_experts, true, s.wide, DType::f32, offsets, d.num_experts, d.max_rows,
                         d.out_features, d.rank, s.tiles, s.tiles_bytes, stream);
  add_scaled_rows_any(s.wide, y, y_dtype, adapter.scaling, offsets, d, d.out_features, true, stream);
}

void lora_experts_backward_cuda(const __nv_bfloat16* xp, const __nv_bfloat16* dy, const LoraDeviceAdapter& adapter,
                                const int32_t* offsets, void* dx, DType dx_dtype, const LoraExpertDims& d,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  check_dims(d, adapter, workspace_bytes, "lora_experts_backward_cuda");
  const bool trained = adapter.grad_a != nullptr;
  if (d.max_rows == 0 || (!trained && dx == nullptr)) return;
  Scratch s;
  scratch_bytes(d, &s, workspace);
  lora_experts_gather_b_cuda(adapter.b, s.b_experts, d, stream);
  // dxa [R, r] = s dy B_e (B_e [out, r] stored [K, N]), formed in fp32 and rounded once after scaling.
  grouped_gemm_rows_cuda(dy, s.b_experts, false, s.wide, DType::f32, offsets, d.num_experts, d.max_rows, d.rank,
                         d.out_features, s.tiles, s.tiles_bytes, stream);
  add_scaled_rows_any(s.wide, s.dxa, DType::bf16, adapter.scaling, offsets, d, d.rank, false, stream);
  if (trained) {
    // xa recomputed; dB_e [out, r] = dy_e^T xa_e (scaled when added back), dA_e [r, in] += dxa_e^T xp_e.
    grouped_gemm_rows_cuda(xp, adapter.a, true, s.xa, DType::bf16, offsets, d.num_experts, d.max_rows, d.rank,
                           d.in_features, s.tiles, s.tiles_bytes, stream);
    grouped_gemm_weight_grad_cuda(dy, s.xa, s.d_b, DType::f32, offsets, d.num_experts, d.out_features, d.rank,
                                  WeightGradOutput::written, stream);
    scatter_add_db_kernel<<<grid_for(d.num_experts * d.out_features * d.rank), 256, 0, stream>>>(
        s.d_b, adapter.grad_b, adapter.scaling, d.num_experts, d.out_features, d.rank);
    CUDA_CHECK_LAUNCH();
    grouped_gemm_weight_grad_cuda(s.dxa, xp, adapter.grad_a, DType::f32, offsets, d.num_experts, d.rank,
                                  d.in_features, WeightGradOutput::added_to, stream);
  }
  if (dx != nullptr) {
    // dx [R, in] += dxa A_e (A_e [r, in] stored [K, N]).
    grouped_gemm_rows_cuda(s.dxa, adapter.a, false, s.wide, DType::f32, offsets, d.num_experts, d.max_rows,
                           d.in_features, d.rank, s.tiles, s.tiles_bytes, stream);
    add_scaled_rows_any(s.wide, dx, dx_dtype, 1.0f, offsets, d, d.in_features, true, stream);
  }
}

}  // namespace deltamoe
