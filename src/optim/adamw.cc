// CPU reference of AdamW over flat buffers: per-step scalars, the per-span update, the range walk.
#include "optim/adamw.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/tensor.h"

namespace deltamoe {

void validate_adamw_config(const AdamWConfig& config) {
  CHECK(config.beta1 >= 0 && config.beta1 < 1, "--adam_beta1 must be in [0, 1), got ", config.beta1);
  CHECK(config.beta2 >= 0 && config.beta2 < 1, "--adam_beta2 must be in [0, 1), got ", config.beta2);
  CHECK(config.eps > 0 && std::isfinite(config.eps), "--adam_epsilon must be a positive number, got ",
        config.eps);
  CHECK(config.weight_decay >= 0 && std::isfinite(config.weight_decay),
        "--weight_decay must be a non-negative number, got ", config.weight_decay);
  CHECK(config.moment_dtype == DType::f32 || config.moment_dtype == DType::bf16,
        "optimizer moments can be stored as f32 or bf16, not ", dtype_name(config.moment_dtype));
}

AdamWStepScalars adamw_step_scalars(const AdamWConfig& config, double lr, int64_t adam_step) {
  CHECK(adam_step >= 1, "adamw_step_scalars: adam_step counts from 1, got ", adam_step);
  CHECK(std::isfinite(lr) && lr >= 0, "adamw_step_scalars: learning rate must be finite and >= 0, got ", lr);
  // The same fp64 expressions as torch's Python code, so the rounding to fp32 matches too.
  const double step = static_cast<double>(adam_step);
  const double bias_correction1 = 1.0 - std::pow(config.beta1, step);
  const double bias_correction2 = 1.0 - std::pow(config.beta2, step);
  const double step_size = lr / bias_correction1;
  AdamWStepScalars scalars;
  scalars.decay_factor = static_cast<float>(1.0 - lr * config.weight_decay);
  scalars.decay_factor_no_decay = 1.0f;
  scalars.one_minus_beta1 = static_cast<float>(1.0 - config.beta1);
  scalars.beta2 = static_cast<float>(config.beta2);
  scalars.one_minus_beta2 = static_cast<float>(1.0 - config.beta2);
  scalars.bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));  // torch: bc2 ** 0.5
  scalars.eps = static_cast<float>(config.eps);
  scalars.neg_step_size = static_cast<float>(-step_size);
  return scalars;
}

namespace {

// torch's lerp: the small-weight form keeps precision near start, the other near end. Fused
// multiply-adds as torch's vectorised CPU kernels compute them: bitwise equal to torch.optim.AdamW
// (adamw_golden_test); the CUDA kernel uses the same fused forms.
inline float torch_lerp(float start, float end, float weight) {
  return std::fabs(weight) < 0.5f ? std::fma(weight, end - start, start) : std::fma(-(end - start), 1.0f - weight, end);
}

// The update of one element; m and v come in as fp32 and leave updated.
inline void adamw_element(const AdamWStepScalars& s, float decay_factor, float& p, float g, float& m, float& v) {
  p = p * decay_factor;
  m = torch_lerp(m, g, s.one_minus_beta1);
  v = std::fma(s.one_minus_beta2 * g, g, v * s.beta2);  // addcmul, fused as torch's vectorised CPU kernel
  const float denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
  p = p + s.neg_step_size * m / denom;                 // addcdiv: self + (value * t1) / t2
}

}  // namespace

void adamw_update_span(const AdamWStepScalars& scalars, bool decay, DType moment_dtype, int64_t count,
                       float* master, const float* grad, void* m, void* v) {
  const float decay_factor = decay ? scalars.decay_factor : scalars.decay_factor_no_decay;
  if (moment_dtype == DType::f32) {
    float* m32 = static_cast<float*>(m);
    float* v32 = static_cast<float*>(v);
    for (int64_t i = 0; i < count; ++i) adamw_element(scalars, decay_factor, master[i], grad[i], m32[i], v32[i]);
    return;
  }
  CHECK(moment_dtype == DType::bf16, "adamw_update_span: moments must be f32 or bf16, not ",
        dtype_name(moment_dtype));
  bf16* m16 = static_cast<bf16*>(m);
  bf16* v16 = static_cast<bf16*>(v);
  for (int64_t i = 0; i < count; ++i) {
    float m_value = static_cast<float>(m16[i]);
    float v_value = static_cast<float>(v16[i]);
    adamw_element(scalars, decay_factor, master[i], grad[i], m_value, v_value);
    m16[i] = bf16(m_value);
    v16[i] = bf16(v_value);
  }
}

AdamW::AdamW(const ParamLayout& layout, const AdamWConfig& config) : AdamW(layout, config, layout.whole()) {}

AdamW::AdamW(const ParamLayout& layout, const AdamWConfig& config, FlatRange range)
    : layout_(layout), config_(config), range_(range) {
  validate_adamw_config(config);
  CHECK(range.begin >= 0 && range.begin <= range.end && range.end <= layout.total_numel(), "AdamW: range [",
        range.begin, ", ", range.end, ") is not inside the flat buffer of ", layout.total_numel(), " elements");
  // HostTensor is zero-filled, and all-zero bytes are 0.0 in f32 and bf16: torch's initial moments.
  exp_avg_ = HostTensor(config.moment_dtype, Shape{range.size()});
  exp_avg_sq_ = HostTensor(config.moment_dtype, Shape{range.size()});
}

void AdamW::step(double lr, float* master, const float* grad) {
  CHECK(range_.size() == 0 || (master != nullptr && grad != nullptr), "AdamW::step: null master or gradient buffer");
  const AdamWStepScalars base_scalars = adamw_step_scalars(config_, lr, adam_step_ + 1);
  const size_t element_size = dtype_size(config_.moment_dtype);
  for (const ParamEntry& entry : layout_.entries()) {
    const int64_t begin = std::max(entry.offset, range_.begin);
    const int64_t end = std::min(entry.offset + entry.numel, range_.end);
    if (begin >= end) continue;
    const int64_t local = begin - range_.begin;
    const AdamWStepScalars scalars =
        entry.lr_scale == 1.0 ? base_scalars : adamw_step_scalars(config_, lr * entry.lr_scale, adam_step_ + 1);
    adamw_update_span(scalars, entry.decay, config_.moment_dtype, end - begin, master + local, grad + local,
                      static_cast<uint8_t*>(exp_avg_.data()) + static_cast<size_t>(local) * element_size,
                      static_cast<uint8_t*>(exp_avg_sq_.data()) + static_cast<size_t>(local) * element_size);
  }
  ++adam_step_;
}

void AdamW::set_adam_step(int64_t adam_step) {
  CHECK(adam_step >= 0, "AdamW::set_adam_step: negative step ", adam_step);
  adam_step_ = adam_step;
}

namespace {
std::vector<float> moments_to_f32(const HostTensor& moments) {
  std::vector<float> out(static_cast<size_t>(moments.numel()));
  convert_floats(moments.data(), moments.dtype(), out.data(), DType::f32, moments.numel());
  return out;
}
std::vector<uint8_t> raw_bytes(const HostTensor& tensor) {
  const auto* begin = static_cast<const uint8_t*>(tensor.data());
  return std::vector<uint8_t>(begin, begin + tensor.nbytes());
}
}  // namespace

std::vector<float> AdamW::exp_avg_f32() const { return moments_to_f32(exp_avg_); }
std::vector<float> AdamW::exp_avg_sq_f32() const { return moments_to_f32(exp_avg_sq_); }
std::vector<uint8_t> AdamW::exp_avg_bytes() const { return raw_bytes(exp_avg_); }
std::vector<uint8_t> AdamW::exp_avg_sq_bytes() const { return raw_bytes(exp_avg_sq_); }

}  // namespace deltamoe
