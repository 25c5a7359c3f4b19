// AdamW on flat fp32 master weights with fp32 or bf16 moments, bit for bit the arithmetic of
// torch.optim.AdamW's single-tensor path (decay first, lerp for m, addcmul for v, eps outside the
// square root). CPU reference now; the CUDA kernel over the same flat buffers follows this spec.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "optim/param_layout.h"

namespace deltamoe {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;  // Megatron / ms-swift default for LLM fine-tuning (torch's is 0.999)
  double eps = 1e-8;
  double weight_decay = 0.1;
  DType moment_dtype = DType::f32;  // f32, or bf16 to halve the optimizer-state memory
};

// Checks ranges (0 <= beta < 1, eps > 0, weight_decay >= 0, moment dtype f32/bf16); the message
// names the flag (--adam_beta1, --adam_beta2, --adam_epsilon, --weight_decay).
void validate_adamw_config(const AdamWConfig& config);

// The per-step scalars, computed once on the host in fp64 the way torch computes its Python
// floats, then rounded to fp32 as torch does when it hands a Python scalar to a float kernel.
// A CUDA kernel takes exactly these.
struct AdamWStepScalars {
  float decay_factor;          // 1 - lr * weight_decay           (param.mul_)
  float decay_factor_no_decay; // 1 (tensors without weight decay)
  float one_minus_beta1;       // lerp weight for m               (exp_avg.lerp_(grad, 1 - beta1))
  float beta2;                 //                                 (exp_avg_sq.mul_(beta2))
  float one_minus_beta2;       //                                 (.addcmul_(grad, grad, 1 - beta2))
  float bias_correction2_sqrt; // sqrt(1 - beta2^t)
  float eps;
  float neg_step_size;         // -lr / (1 - beta1^t)             (param.addcdiv_(m, denom, -step_size))
};

// adam_step is t after the increment, i.e. 1 for the first update.
AdamWStepScalars adamw_step_scalars(const AdamWConfig& config, double lr, int64_t adam_step);

// One AdamW update of count contiguous elements (one tensor or a piece of one):
//   p = p * decay_factor                       (decay_factor = 1 when decay is false)
//   m = lerp(m, g, 1 - beta1)                  (m + w * (g - m), torch's small-weight form)
//   v = v * beta2 + (1 - beta2) * g * g
//   p = p + (-step_size) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// master and grad are f32; m and v point at count elements of moment_dtype. With bf16 moments
// the update uses the fresh fp32 m and v and only the stored copies are rounded (nearest-even).
// master, m and v are updated in place; grad is read only.
void adamw_update_span(const AdamWStepScalars& scalars, bool decay, DType moment_dtype, int64_t count,
                       float* master, const float* grad, void* m, void* v);

// AdamW over one FlatRange of a ParamLayout. It owns the moments of that range (zero at start);
// master weights and gradients belong to the caller and are passed per step as range-local
// buffers (element i is flat element range.begin + i). Padding and parts of the range outside
// any tensor are left untouched.
class AdamW {
 public:
  AdamW(const ParamLayout& layout, const AdamWConfig& config);
  AdamW(const ParamLayout& layout, const AdamWConfig& config, FlatRange range);
  AdamW(AdamW&&) = default;
  AdamW& operator=(AdamW&&) = default;
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  // Applies one update with learning rate lr and advances adam_step(). master and grad hold
  // range().size() fp32 values.
  void step(double lr, float* master, const float* grad);

  const ParamLayout& layout() const { return layout_; }
  const AdamWConfig& config() const { return config_; }
  FlatRange range() const { return range_; }
  // Number of updates applied so far (torch's state['step']); bias correction uses it.
  int64_t adam_step() const { return adam_step_; }

  // The moment storage: range().size() elements of config().moment_dtype each, 64-byte aligned.
  // Views into this optimizer's buffers, used to save and restore the state bitwise.
  TensorView exp_avg() const { return exp_avg_.view(); }
  TensorView exp_avg_sq() const { return exp_avg_sq_.view(); }
  void set_adam_step(int64_t adam_step);

  // Copies of the raw moment bytes (for bitwise comparisons).
  std::vector<uint8_t> exp_avg_bytes() const;
  std::vector<uint8_t> exp_avg_sq_bytes() const;
  // fp32 copies of the moments (for tests and logging).
  std::vector<float> exp_avg_f32() const;
  std::vector<float> exp_avg_sq_f32() const;

 private:
  ParamLayout layout_;
  AdamWConfig config_;
  FlatRange range_;
  int64_t adam_step_ = 0;
  HostTensor exp_avg_;     // owning; AdamW is move-only so that two optimizers never share it
  HostTensor exp_avg_sq_;
};

}  // namespace deltamoe
