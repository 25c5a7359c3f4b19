// Names, shapes, checks and test initialisation of the text tower's fp32 parameters.
#include "model/text/text_params.h"

#include "core/error.h"
#include "core/rng.h"

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
  CHECK(static_cast<int64_t>(c.layer_types.size()) == c.num_hidden_layers, "text config: layer_types has ",
        c.layer_types.size(), " entries for num_hidden_layers = ", c.num_hidden_layers);
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  const int64_t Is = c.shared_expert_intermediate_size, D = c.head_dim;
  const int64_t key_dim = c.linear_num_key_heads * c.linear_key_head_dim;
  const int64_t value_dim = c.linear_num_value_heads * c.linear_value_head_dim;
  const int64_t conv_dim = 2 * key_dim + value_dim;
  std::vector<NamedShape> shapes;
  shapes.push_back({prefix + ".embed_tokens.weight", {c.vocab_size, H}});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = layer_prefix(prefix, i);
    shapes.push_back({p + "input_layernorm.weight", {H}});
    shapes.push_back({p + "post_attention_layernorm.weight", {H}});
    if (c.layer_types[i] == LayerType::linear_attention) {
      const std::string g = p + "linear_attn.";
      shapes.push_back({g + "in_proj_qkv.weight", {conv_dim, H}});
      shapes.push_back({g + "in_proj_z.weight", {value_dim, H}});
      shapes.push_back({g + "in_proj_b.weight", {c.linear_num_value_heads, H}});
      shapes.push_back({g + "in_proj_a.weight", {c.linear_num_value_heads, H}});
      shapes.push_back({g + "conv1d.weight", {conv_dim, 1, c.linear_conv_kernel_dim}});
      shapes.push_back({g + "dt_bias", {c.linear_num_value_heads}});
      shapes.push_back({g + "A_log", {c.linear_num_value_heads}});
      shapes.push_back({g + "norm.weight", {c.linear_value_head_dim}});
      shapes.push_back({g + "out_proj.weight", {H, value_dim}});
    } else {
      const std::string a = p + "self_attn.";
      shapes.push_back({a + "q_proj.weight", {2 * c.num_attention_heads * D, H}});
      shapes.push_back({a + "k_proj.weight", {c.num_key_value_heads * D, H}});
      shapes.push_back({a + "v_proj.weight", {c.num_key_value_heads * D, H}});
      shapes.push_back({a + "o_proj.weight", {H, c.num_attention_heads * D}});
      shapes.push_back({a + "q_norm.weight", {D}});
      shapes.push_back({a + "k_norm.weight", {D}});
    }
    const std::string m = p + "mlp.";
    shapes.push_back({m + "gate.weight", {E, H}});
    shapes.push_back({m + "experts.gate_up_proj", {E, 2 * I, H}});
    shapes.push_back({m + "experts.down_proj", {E, H, I}});
    shapes.push_back({m + "shared_expert.gate_proj.weight", {Is, H}});
    shapes.push_back({m + "shared_expert.up_proj.weight", {Is, H}});
    shapes.push_back({m + "shared_expert.down_proj.weight", {H, Is}});
    shapes.push_back({m + "shared_expert_gate.weight", {1, H}});
  }
  shapes.push_back({prefix + ".norm.weight", {H}});
  shapes.push_back({"lm_head.weight", {c.vocab_size, H}});
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
  if (grads_ == nullptr) {
    ++counts.skipped, counts.skipped_values += values;
    return nullptr;
  }
  ++counts.computed, counts.computed_values += values;
  return param_values(*grads_, name);
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
