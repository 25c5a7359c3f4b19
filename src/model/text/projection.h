// The text model's one way to apply a weight (compare llama.cpp's build_lora_mm): every linear
// projection goes through project_forward / project_backward, which add the module's LoRA adapter
// when the parameter map holds one (model/lora/lora.h names its entries); the fused kernels (routed
// experts, shared expert) read their weights through FusedWeight, which merges an adapter in.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/text/text_params.h"

namespace deltamoe {

// Whether params holds an adapter for the weight module (a Linear module name, or a fused
// expert parameter name).
bool has_adapter(const ParamMap& params, const std::string& module);

// Whether the module's adapter drops part of its input in this pass: it has an adapter with an
// index entry and a LoRA dropout scope with p > 0 is open (model/lora/lora_dropout.h). The fused
// kernels cannot express dropout on the adapter's input; such a module goes through
// project_forward / project_backward instead of FusedWeight.
bool adapter_drops(const ParamMap& params, const std::string& module);

// y [rows, out] = x W^T with W = params[module + ".weight"] [out, in], plus
// scale * (x' A^T) B^T when the module has an adapter, x' = dropout(x) in a training pass with
// LoRA dropout (the rows are the micro-batch's token rows 0 .. rows - 1 of the mask), else x.
void project_forward(const ParamMap& params, const std::string& module, const float* x, float* y, int64_t rows,
                     int64_t in_features, int64_t out_features);

// dy [rows, out] -> dx [rows, in] written (null: skipped). W's gradient is added when grad has one
// (trained base), A's and B's when grad has them (trained adapter).
void project_backward(const ParamMap& params, const LayerGrads& grad, const std::string& module, const float* x,
                      const float* dy, float* dx, int64_t rows, int64_t in_features, int64_t out_features);

// A whole weight as a fused kernel reads it: W itself, or W + delta when it carries an adapter (as
// PEFT's ParamWrapper does for the experts). grad() is where the kernel adds dW (null: not needed);
// finish_backward() turns that into the adapter's dA and dB. Refuses a module whose adapter drops
// (adapter_drops): merging cannot express dropout on the adapter's input.
class FusedWeight {
 public:
  // weight_name: "<module>.weight" for a Linear, the parameter itself for fused experts.
  FusedWeight(const ParamMap& params, const LayerGrads* grad, const std::string& weight_name);
  const float* value() const { return value_; }
  float* grad() { return grad_; }
  void finish_backward();

 private:
  const ParamMap& params_;
  const LayerGrads* layer_grads_;
  std::string weight_name_, module_;
  bool adapted_ = false;
  const float* value_ = nullptr;
  float* grad_ = nullptr;
  std::vector<float> merged_, d_merged_;
};

}  // namespace deltamoe
