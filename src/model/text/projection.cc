// The projection funnel of the text model (see projection.h): base product plus the LoRA path
// x -> x A^T -> (x A^T) B^T * scale, and the merged weight the fused kernels read.
#include "model/text/projection.h"

#include "core/error.h"
#include "kernels/linear/linear.h"
#include "model/lora/lora.h"
#include "model/lora/lora_dropout.h"

namespace deltamoe {

namespace {

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

struct Adapter {
  LoraTarget target;
  int64_t rank = 0;
  double scaling = 0;
  const float* a = nullptr;
  const float* b = nullptr;
  LoraDropoutMask dropout;  // of the open training pass (model/lora/lora_dropout.h); inactive: none
};

// The adapter of module as stored in params (shapes checked against the weight's).
Adapter adapter_of(const ParamMap& params, const std::string& module, const std::vector<int64_t>& weight_shape,
                   bool experts) {
  Adapter adapter;
  adapter.target.module = module;
  adapter.target.experts = experts;
  adapter.target.num_experts = experts ? weight_shape.at(0) : 1;
  // Linear [out, in]; experts [E, out, in].
  adapter.target.in_features = experts ? weight_shape.at(2) : weight_shape.at(1);
  adapter.target.out_features = experts ? weight_shape.at(1) : weight_shape.at(0);
  const ParamTensor& a = params.at(adapter.target.a_name());
  const ParamTensor& b = params.at(adapter.target.b_name());
  CHECK(a.shape.size() == 2 && a.shape[0] % adapter.target.num_experts == 0, "LoRA: '", adapter.target.a_name(),
        "' has a shape that does not fit its weight");
  adapter.rank = a.shape[0] / adapter.target.num_experts;
  CHECK(a.shape == adapter.target.a_shape(adapter.rank) && b.shape == adapter.target.b_shape(adapter.rank),
        "LoRA: the adapter of '", module, "' does not fit its weight (A and B must be ",
        "[r * E, in] and [out, r * E])");
  auto scaling = params.find(adapter.target.scaling_name());
  CHECK(scaling != params.end() && scaling->second.values.size() == 1, "LoRA: '", module,
        "' has A and B but no scaling entry");
  adapter.scaling = scaling->second.values[0];
  adapter.a = a.values.data();
  adapter.b = b.values.data();
  auto index = params.find(module + ".lora_index");
  if (index != params.end()) {
    CHECK(index->second.values.size() == 1, "LoRA: '", module, ".lora_index' must hold one value");
    adapter.dropout = lora_dropout_for(static_cast<int64_t>(index->second.values[0]));
  }
  return adapter;
}

// x itself, or dropout(x) in *storage when the mask is active.
const float* dropped_input(const LoraDropoutMask& mask, const float* x, int64_t rows, int64_t cols,
                           std::vector<float>* storage) {
  if (!mask.active()) return x;
  storage->resize(static_cast<size_t>(rows * cols));
  lora_dropout_apply_ref(mask, x, storage->data(), rows, cols);
  return storage->data();
}

}  // namespace

bool has_adapter(const ParamMap& params, const std::string& module) {
  return params.count(module + ".lora_A.weight") != 0;
}

bool adapter_drops(const ParamMap& params, const std::string& module) {
  if (!has_adapter(params, module)) return false;
  auto index = params.find(module + ".lora_index");
  return index != params.end() && !index->second.values.empty() &&
         lora_dropout_for(static_cast<int64_t>(index->second.values[0])).active();
}

void project_forward(const ParamMap& params, const std::string& module, const float* x, float* y, int64_t rows,
                     int64_t in_features, int64_t out_features) {
  linear_forward_ref(x, param_values(params, module + ".weight"), y, rows, in_features, out_features);
  if (!has_adapter(params, module)) return;
  const Adapter ad = adapter_of(params, module, {out_features, in_features}, false);
  std::vector<float> xa(static_cast<size_t>(rows * ad.rank)), lora(static_cast<size_t>(rows * out_features));
  // PEFT's B(A(dropout(x))): only the adapter's input is dropped.
  std::vector<float> x_dropped;
  const float* x_lora = dropped_input(ad.dropout, x, rows, in_features, &x_dropped);
  linear_forward_ref(x_lora, ad.a, xa.data(), rows, in_features, ad.rank);
  linear_forward_ref(xa.data(), ad.b, lora.data(), rows, ad.rank, out_features);
  const float s = static_cast<float>(ad.scaling);
  for (int64_t i = 0; i < rows * out_features; ++i) y[i] += lora[i] * s;
}

void project_backward(const ParamMap& params, const LayerGrads& grad, const std::string& module, const float* x,
                      const float* dy, float* dx, int64_t rows, int64_t in_features, int64_t out_features) {
  linear_backward_ref(x, param_values(params, module + ".weight"), dy, dx, grad.of(module + ".weight"), rows,
                      in_features, out_features);
  if (!has_adapter(params, module)) return;
  const Adapter ad = adapter_of(params, module, {out_features, in_features}, false);
  float* d_a = grad.of(ad.target.a_name());
  float* d_b = grad.of(ad.target.b_name());
  if (dx == nullptr && d_a == nullptr && d_b == nullptr) return;
  // y += s * (x' A^T) B^T with x' = dropout(x) (x itself without dropout): d(x'A^T) = s * dy B,
  // dB += s * dy^T (x' A^T), dA += d(x'A^T)^T x', dx += dropout'(d(x'A^T) A) (the same mask and scale).
  const float s = static_cast<float>(ad.scaling);
  std::vector<float> x_dropped;
  const float* x_lora = dropped_input(ad.dropout, x, rows, in_features, &x_dropped);
  std::vector<float> xa(static_cast<size_t>(rows * ad.rank)), dy_s(static_cast<size_t>(rows * out_features));
  linear_forward_ref(x_lora, ad.a, xa.data(), rows, in_features, ad.rank);
  for (int64_t i = 0; i < rows * out_features; ++i) dy_s[i] = dy[i] * s;
  std::vector<float> d_xa(static_cast<size_t>(rows * ad.rank));
  linear_backward_ref(xa.data(), ad.b, dy_s.data(), d_xa.data(), d_b, rows, ad.rank, out_features);
  std::vector<float> dx_part(dx != nullptr ? static_cast<size_t>(rows * in_features) : 0);
  linear_backward_ref(x_lora, ad.a, d_xa.data(), dx != nullptr ? dx_part.data() : nullptr, d_a, rows, in_features,
                      ad.rank);
  if (dx != nullptr) {
    if (ad.dropout.active()) lora_dropout_apply_ref(ad.dropout, dx_part.data(), dx_part.data(), rows, in_features);
    for (int64_t i = 0; i < rows * in_features; ++i) dx[i] += dx_part[i];
  }
}

FusedWeight::FusedWeight(const ParamMap& params, const LayerGrads* grad, const std::string& weight_name)
    : params_(params), layer_grads_(grad), weight_name_(weight_name) {
  const bool linear = ends_with(weight_name, ".weight");
  module_ = linear ? weight_name.substr(0, weight_name.size() - 7) : weight_name;
  const ParamTensor& weight = params.at(weight_name);
  value_ = weight.values.data();
  grad_ = grad != nullptr ? grad->of(weight_name) : nullptr;
  adapted_ = has_adapter(params, module_);
  if (!adapted_) return;
  CHECK(!adapter_drops(params, module_), "LoRA: '", module_, "' has LoRA dropout, which a merged weight cannot ",
        "express (PEFT refuses lora_dropout for --target_parameters; the shared expert runs unmerged)");
  const Adapter ad = adapter_of(params, module_, weight.shape, !linear);
  merged_.resize(weight.values.size());
  lora_delta(ad.target, ad.rank, ad.a, ad.b, ad.scaling, merged_.data());
  for (size_t i = 0; i < merged_.size(); ++i) merged_[i] += weight.values[i];
  value_ = merged_.data();
  if (grad == nullptr) return;
  const bool adapter_trained = grad->of(ad.target.a_name()) != nullptr || grad->of(ad.target.b_name()) != nullptr;
  CHECK(grad_ == nullptr || !adapter_trained, "LoRA: '", weight_name, "' is trained whole and has an adapter");
  if (adapter_trained) {
    d_merged_.assign(weight.values.size(), 0.0f);
    grad_ = d_merged_.data();
  }
}

void FusedWeight::finish_backward() {
  if (!adapted_ || d_merged_.empty()) return;
  const Adapter ad = adapter_of(params_, module_, params_.at(weight_name_).shape, !ends_with(weight_name_, ".weight"));
  float* d_a = layer_grads_->of(ad.target.a_name());
  float* d_b = layer_grads_->of(ad.target.b_name());
  std::vector<float> scratch_a, scratch_b;
  if (d_a == nullptr) scratch_a.assign(params_.at(ad.target.a_name()).values.size(), 0.0f), d_a = scratch_a.data();
  if (d_b == nullptr) scratch_b.assign(params_.at(ad.target.b_name()).values.size(), 0.0f), d_b = scratch_b.data();
  lora_delta_backward(ad.target, ad.rank, ad.a, ad.b, ad.scaling, d_merged_.data(), d_a, d_b);
}

}  // namespace deltamoe
