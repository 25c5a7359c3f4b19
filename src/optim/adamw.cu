// CUDA AdamW: one element per thread (grid-stride), written with explicitly rounded intrinsics so
// the compiler cannot contract a*b+c into FMA and the result equals the CPU reference bitwise.
#include <algorithm>

#include "core/cuda_check.h"
#include "optim/adamw_cuda.h"

namespace deltamoe {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

// torch's lerp, fused as the CPU reference writes it (bitwise equal to torch's CPU AdamW).
__device__ __forceinline__ float torch_lerp(float start, float end, float weight) {
  const float diff = __fsub_rn(end, start);
  return fabsf(weight) < 0.5f ? __fmaf_rn(weight, diff, start) : __fmaf_rn(-diff, __fsub_rn(1.0f, weight), end);
}

__device__ __forceinline__ void adamw_element(const AdamWStepScalars& s, float decay_factor, float& p, float g,
                                              float& m, float& v) {
  p = __fmul_rn(p, decay_factor);
  m = torch_lerp(m, g, s.one_minus_beta1);
  v = __fmaf_rn(__fmul_rn(s.one_minus_beta2, g), g, __fmul_rn(v, s.beta2));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bias_correction2_sqrt), s.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
}

template <typename Moment>
__device__ __forceinline__ float load_moment(const Moment* ptr, int64_t i) {
  if constexpr (sizeof(Moment) == 2) {
    return __bfloat162float(ptr[i]);
  } else {
    return ptr[i];
  }
}

template <typename Moment>
__device__ __forceinline__ void store_moment(Moment* ptr, int64_t i, float value) {
  if constexpr (sizeof(Moment) == 2) {
    ptr[i] = __float2bfloat16_rn(value);
  } else {
    ptr[i] = value;
  }
}

template <typename Moment>
__global__ void adamw_kernel(AdamWStepScalars scalars, float decay_factor, int64_t count, float* master,
                             const float* grad, GradientScaling scaling, Moment* m, Moment* v,
                             __nv_bfloat16* weights_bf16) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const bool divide = scaling.divisor != 1.0, clip = scaling.clip_coef < 1.0f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count; i += stride) {
    float p = master[i], m_value = load_moment(m, i), v_value = load_moment(v, i);
    float g = grad[i];
    if (divide) g = __double2float_rn(__ddiv_rn(static_cast<double>(g), scaling.divisor));
    if (clip) g = __fmul_rn(g, scaling.clip_coef);
    adamw_element(scalars, decay_factor, p, g, m_value, v_value);
    master[i] = p;
    store_moment(m, i, m_value);
    store_moment(v, i, v_value);
    if (weights_bf16 != nullptr) weights_bf16[i] = __float2bfloat16_rn(p);
  }
}

}  // namespace

void adamw_update_span_cuda(const AdamWStepScalars& scalars, bool decay, DType moment_dtype, int64_t count,
                            float* master, const float* grad, const GradientScaling& scaling, void* m, void* v,
                            __nv_bfloat16* weights_bf16, cudaStream_t stream) {
  CHECK(scaling.divisor > 0 && scaling.clip_coef > 0, "adamw_update_span_cuda: gradient divisor ", scaling.divisor,
        " and clip factor ", scaling.clip_coef, " must be positive");
  CHECK(count >= 0, "adamw_update_span_cuda: negative count ", count);
  CHECK(moment_dtype == DType::f32 || moment_dtype == DType::bf16,
        "adamw_update_span_cuda: moments must be f32 or bf16, not ", dtype_name(moment_dtype));
  if (count == 0) return;
  CHECK(master != nullptr && grad != nullptr && m != nullptr && v != nullptr,
        "adamw_update_span_cuda: null master, gradient or moment buffer");
  const float decay_factor = decay ? scalars.decay_factor : scalars.decay_factor_no_decay;
  const unsigned blocks = static_cast<unsigned>(std::min(kMaxBlocks, (count + kThreads - 1) / kThreads));
  if (moment_dtype == DType::f32) {
    adamw_kernel<float><<<blocks, kThreads, 0, stream>>>(scalars, decay_factor, count, master, grad, scaling,
                                                         static_cast<float*>(m), static_cast<float*>(v),
                                                         weights_bf16);
  } else {
    adamw_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(scalars, decay_factor, count, master, grad,
                                                                 scaling, static_cast<__nv_bfloat16*>(m),
                                                                 static_cast<__nv_bfloat16*>(v), weights_bf16);
  }
  CUDA_CHECK_LAUNCH();
}

void adamw_step_cuda(const ParamLayout& layout, const AdamWConfig& config, double lr, int64_t adam_step,
                     const GradientScaling& scaling, float* master, const float* grad, void* m, void* v,
                     const std::vector<__nv_bfloat16*>& weights_bf16, cudaStream_t stream) {
  validate_adamw_config(config);
  CHECK(static_cast<int>(weights_bf16.size()) == layout.num_tensors(), "adamw_step_cuda: ", weights_bf16.size(),
        " bf16 destinations for ", layout.num_tensors(), " pieces");
  const AdamWStepScalars base_scalars = adamw_step_scalars(config, lr, adam_step);
  const size_t element_size = dtype_size(config.moment_dtype);
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const ParamEntry& entry = layout.entry(i);
    const AdamWStepScalars scalars =
        entry.lr_scale == 1.0 ? base_scalars : adamw_step_scalars(config, lr * entry.lr_scale, adam_step);
    const size_t moment_offset = static_cast<size_t>(entry.offset) * element_size;
    adamw_update_span_cuda(scalars, entry.decay, config.moment_dtype, entry.numel, master + entry.offset,
                           grad + entry.offset, scaling, static_cast<uint8_t*>(m) + moment_offset,
                           static_cast<uint8_t*>(v) + moment_offset, weights_bf16[static_cast<size_t>(i)], stream);
  }
}

}  // namespace deltamoe
