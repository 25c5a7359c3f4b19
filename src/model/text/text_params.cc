// Names, shapes, checks and test initialisation of the text tower's fp32 parameters.
#include "model/text/text_params.h"

#include "core/error.h"
#include "core/rng.h"
#include "model/param_table.h"

namespace deltamoe {

namespace {

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  return count;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::string layer_prefix(const std::string& prefix, int64_t layer_idx) {
  return str_cat(prefix, ".layers.", layer_idx, ".");
}

int64_t text_rotary_dim(const TextConfig& config) {
  return static_cast<int64_t>(static_cast<double>(config.head_dim) * config.partial_rotary_factor);
}

std::vector<NamedShape> text_param_shapes(const TextConfig& c, const std::string& prefix) {
  // The names, shapes and order of the parameter table (model/param_table.h), without lm_head's
  // tie question: the text model always has its own lm_head.
  std::vector<NamedShape> shapes;
  for (const ParamSpec& spec : text_param_table(c, prefix, true)) shapes.push_back({spec.name, spec.shape.to_vector()});
  return shapes;
}

void check_text_params(const ParamMap& params, const TextConfig& config, const std::string& prefix) {
  for (const NamedShape& expected : text_param_shapes(config, prefix)) {
    auto it = params.find(expected.name);
    CHECK(it != params.end(), "text model: parameter '", expected.name, "' is missing");
    CHECK(it->second.shape == expected.shape, "text model: parameter '", expected.name, "' has shape ",
          shape_text(it->second.shape), ", expected ", shape_text(expected.shape));
    CHECK(static_cast<int64_t>(it->second.values.size()) == numel_of(expected.shape), "text model: parameter '",
          expected.name, "' holds ", it->second.values.size(), " values for shape ", shape_text(expected.shape));
  }
}

const float* param_values(const ParamMap& params, const std::string& name) {
  auto it = params.find(name);
  CHECK(it != params.end(), "text model: parameter '", name, "' is missing");
  return it->second.values.data();
}

float* param_values(ParamMap& params, const std::string& name) {
  auto it = params.find(name);
  CHECK(it != params.end(), "text model: parameter '", name, "' is missing");
  return it->second.values.data();
}

ParamMap zeros_like(const ParamMap& params) {
  ParamMap zeros;
  for (const auto& [name, tensor] : params)
    zeros[name] = {tensor.shape, std::vector<float>(tensor.values.size(), 0.0f)};
  return zeros;
}

WeightGradCounts& weight_grad_counts() {
  thread_local WeightGradCounts counts;
  return counts;
}

float* LayerGrads::of(const std::string& name) const {
  auto it = params_.find(name);
  CHECK(it != params_.end(), "text model: parameter '", name, "' is missing");
  const auto values = static_cast<int64_t>(it->second.values.size());
  WeightGradCounts& counts = weight_grad_counts();
  auto grad = grads_ != nullptr ? grads_->find(name) : ParamMap::iterator{};
  if (grads_ == nullptr || grad == grads_->end()) {
    ++counts.skipped, counts.skipped_values += values;
    return nullptr;
  }
  ++counts.computed, counts.computed_values += values;
  return grad->second.values.data();
}

ParamMap random_text_params(const TextConfig& config, const std::string& prefix, uint64_t seed, double matrix_std) {
  Rng rng(seed);
  ParamMap params;
  for (const NamedShape& spec : text_param_shapes(config, prefix)) {
    ParamTensor tensor{spec.shape, std::vector<float>(static_cast<size_t>(numel_of(spec.shape)))};
    const bool is_vector = spec.shape.size() == 1;
    double offset = 0, scale = matrix_std;
    if (ends_with(spec.name, "linear_attn.norm.weight")) {
      offset = 1.0, scale = 0.3;  // plain weight, applied as w
    } else if (ends_with(spec.name, "A_log") || ends_with(spec.name, "dt_bias")) {
      scale = 0.5;
    } else if (is_vector) {
      scale = 0.3;  // zero-centred norm weights, applied as 1 + w
    }
    for (float& value : tensor.values) value = static_cast<float>(offset + scale * rng.normal());
    params[spec.name] = std::move(tensor);
  }
  return params;
}

}  // namespace deltamoe
