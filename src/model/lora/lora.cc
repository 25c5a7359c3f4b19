// LoRA targets, initialisation, the adapter's weight delta and PEFT's key names (see lora.h).
#include "model/lora/lora.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <set>

#include "core/error.h"
#include "core/rng.h"
#include "model/param_table.h"

namespace deltamoe {

namespace {

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// PEFT's rule for one target_modules / target_parameters entry.
bool name_matches(const std::string& name, const std::string& key) { return name == key || ends_with(name, "." + key); }

std::string module_of(const std::string& param_name) { return param_name.substr(0, param_name.rfind('.')); }

bool is_all_linear(const std::string& value) {
  std::string lower = value;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  return lower == "all-linear";
}

// The modules that are not nn.Linear in transformers although they hold a 2-D ".weight".
bool is_non_linear_matrix(const std::string& module) {
  return ends_with(module, ".embed_tokens") || ends_with(module, ".pos_embed") || ends_with(module, ".mlp.gate");
}

bool is_expert_param(const std::string& name) {
  return ends_with(name, ".mlp.experts.gate_up_proj") || ends_with(name, ".mlp.experts.down_proj");
}

std::string joined(const std::vector<std::string>& values) {
  std::string text;
  for (const std::string& value : values) text += (text.empty() ? "" : ", ") + value;
  return text;
}

}  // namespace

int64_t lora_dense_max_in_features(const std::vector<LoraTarget>& targets, bool vision) {
  int64_t widest = 0;
  for (const LoraTarget& target : targets) {
    if (target.experts || target.module.starts_with("model.visual.") != vision) continue;
    widest = std::max(widest, target.in_features);
  }
  return widest;
}

double LoraOptions::scaling() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

void LoraOptions::validate() const {
  CHECK(rank > 0, "--lora_rank must be a positive integer, got ", rank);
  CHECK(std::isfinite(alpha) && alpha > 0, "--lora_alpha must be a positive number, got ", alpha);
  CHECK(std::isfinite(dropout) && dropout >= 0 && dropout < 1, "--lora_dropout must be in [0, 1), got ", dropout);
  // PEFT's ParamWrapper raises for lora_dropout != 0: x cannot be factored out of B(A(dropout(x))) for
  // a wrapped parameter, so PEFT (and ms-swift through it) never trains the experts with dropout.
  CHECK(dropout == 0 || target_parameters.empty(), "--lora_dropout ", dropout, " cannot be combined with ",
        "--target_parameters (", joined(target_parameters), "): PEFT's ParamWrapper refuses lora_dropout != 0 for ",
        "targeted parameters (the routed experts); use --lora_dropout 0 or drop --target_parameters");
  CHECK(dtype.empty() || dtype == "float32" || dtype == "fp32" || dtype == "None" || dtype == "none",
        "--lora_dtype ", dtype, " is not supported: adapters are trained in float32 (the default; PEFT's autocast ",
        "does the same); drop the flag or use --lora_dtype float32");
  CHECK(!target_modules.empty() || !target_parameters.empty(),
        "LoRA needs --target_modules (e.g. all-linear) or --target_parameters");
  for (const std::string& entry : target_modules) {
    CHECK(!is_all_linear(entry) || target_modules.size() == 1, "--target_modules all-linear cannot be combined with ",
          "other module names (", joined(target_modules), "); give all-linear alone or a list of names");
  }
}

std::vector<LoraTarget> linear_modules(const ModelConfig& config) {
  const std::vector<ParamSpec> table = build_param_table(config, DType::f32);
  std::set<std::string> names;
  for (const ParamSpec& spec : table) names.insert(spec.name);
  std::vector<LoraTarget> modules;
  for (const ParamSpec& spec : table) {
    if (spec.shape.rank() != 2 || !ends_with(spec.name, ".weight")) continue;
    const std::string module = module_of(spec.name);
    if (is_non_linear_matrix(module)) continue;
    LoraTarget target;
    target.module = module;
    target.out_features = spec.shape[0];
    target.in_features = spec.shape[1];
    target.has_bias = names.count(module + ".bias") != 0;
    modules.push_back(target);
  }
  return modules;
}

std::vector<LoraTarget> resolve_lora_targets(const ModelConfig& config, const LoraOptions& options) {
  options.validate();
  std::vector<LoraTarget> targets;
  const std::vector<LoraTarget> linears = linear_modules(config);
  const bool all_linear = options.target_modules.size() == 1 && is_all_linear(options.target_modules[0]);
  std::set<std::string> all_modules;
  for (const ParamSpec& spec : build_param_table(config, DType::f32)) {
    all_modules.insert(module_of(spec.name));
  }
  std::set<std::string> chosen;
  if (all_linear) {
    for (const LoraTarget& linear : linears) {
      if (linear.module != "lm_head") chosen.insert(linear.module);  // PEFT leaves the output embedding out
    }
  } else {
    for (const std::string& key : options.target_modules) {
      bool found = false;
      for (const LoraTarget& linear : linears) {
        if (name_matches(linear.module, key)) chosen.insert(linear.module), found = true;
      }
      if (found) continue;
      for (const std::string& module : all_modules) {
        CHECK(!name_matches(module, key), "--target_modules ", key, " names '", module, "', which is not a Linear ",
              "layer in transformers (routers, experts, convolutions, embeddings and norms cannot take a LoRA ",
              "adapter; the routed experts' fused weights are --target_parameters mlp.experts.gate_up_proj ",
              "mlp.experts.down_proj)");
      }
      RAISE("--target_modules ", key, " matches no module of the model (e.g. q_proj, in_proj_qkv, ",
            "shared_expert.gate_proj, attn.qkv, or all-linear)");
    }
  }
  for (const LoraTarget& linear : linears) {
    if (chosen.count(linear.module)) targets.push_back(linear);
  }
  std::vector<ParamSpec> experts;
  for (const ParamSpec& spec : build_param_table(config, DType::f32)) {
    if (is_expert_param(spec.name)) experts.push_back(spec);
  }
  std::set<std::string> expert_chosen;
  for (const std::string& key : options.target_parameters) {
    bool found = false;
    for (const ParamSpec& spec : experts) {
      if (name_matches(spec.name, key)) expert_chosen.insert(spec.name), found = true;
    }
    CHECK(found, "--target_parameters ", key, " matches no routed-expert parameter; deltamoe adapts the fused ",
          "expert weights mlp.experts.gate_up_proj and mlp.experts.down_proj (other parameters: use ",
          "--target_modules)");
  }
  for (const ParamSpec& spec : experts) {
    if (!expert_chosen.count(spec.name)) continue;
    LoraTarget target;
    target.module = spec.name;
    target.experts = true;
    target.num_experts = spec.shape[0];
    target.out_features = spec.shape[1];  // [E, out, in]: each expert's weight in torch's Linear order
    target.in_features = spec.shape[2];
    targets.push_back(target);
  }
  CHECK(!targets.empty(), "LoRA: --target_modules / --target_parameters select no weight");
  return targets;
}

std::vector<std::string> resolve_modules_to_save(const ModelConfig& config, const LoraOptions& options) {
  std::vector<std::string> names;
  const std::vector<LoraTarget> targets =
      options.modules_to_save.empty() ? std::vector<LoraTarget>{} : resolve_lora_targets(config, options);
  for (const std::string& key : options.modules_to_save) {
    bool found = false;
    for (const ParamSpec& spec : build_param_table(config, DType::f32)) {
      const std::string module = module_of(spec.name);
      if (!name_matches(module, key)) continue;
      for (const LoraTarget& target : targets) {
        CHECK(target.module != module && target.module != spec.name, "--modules_to_save ", key, " names '", module,
              "', which also has a LoRA adapter; a module is either adapted or trained whole");
      }
      names.push_back(spec.name);
      found = true;
    }
    CHECK(found, "--modules_to_save ", key, " matches no module of the model (e.g. lm_head, embed_tokens)");
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

void init_lora_a(const LoraTarget& target, int64_t rank, uint64_t seed, uint64_t stream, std::vector<float>* a) {
  // kaiming_uniform_(a=sqrt(5)) on a [rank * E, in_features] nn.Linear weight: gain sqrt(2 / 6),
  // bound gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in).
  const double bound = 1.0 / std::sqrt(static_cast<double>(target.in_features));
  Rng rng(seed, stream);
  a->resize(static_cast<size_t>(rank * target.num_experts * target.in_features));
  for (float& value : *a) value = static_cast<float>((2.0 * rng.uniform_f64() - 1.0) * bound);
}

template <typename T>
void lora_delta(const LoraTarget& t, int64_t r, const T* a, const T* b, double scaling, T* delta) {
  const T s = static_cast<T>(scaling);
  if (!t.experts) {  // [out, in] = s B A
    for (int64_t o = 0; o < t.out_features; ++o)
      for (int64_t i = 0; i < t.in_features; ++i) {
        T sum = 0;
        for (int64_t j = 0; j < r; ++j) sum += b[o * r + j] * a[j * t.in_features + i];
        delta[o * t.in_features + i] = s * sum;
      }
    return;
  }
  const int64_t E = t.num_experts, in = t.in_features, out = t.out_features;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        T sum = 0;
        for (int64_t j = 0; j < r; ++j) sum += b[o * r * E + j * E + e] * a[(e * r + j) * in + i];
        delta[(e * out + o) * in + i] = s * sum;
      }
}

template <typename T>
void lora_delta_backward(const LoraTarget& t, int64_t r, const T* a, const T* b, double scaling, const T* d_weight,
                         T* d_a, T* d_b) {
  const T s = static_cast<T>(scaling);
  if (!t.experts) {
    const int64_t out = t.out_features, in = t.in_features;
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        const T g = s * d_weight[o * in + i];
        if (g == T(0)) continue;
        for (int64_t j = 0; j < r; ++j) {
          d_a[j * in + i] += b[o * r + j] * g;
          d_b[o * r + j] += g * a[j * in + i];
        }
      }
    return;
  }
  const int64_t E = t.num_experts, in = t.in_features, out = t.out_features;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        const T g = s * d_weight[(e * out + o) * in + i];
        if (g == T(0)) continue;
        for (int64_t j = 0; j < r; ++j) {
          d_a[(e * r + j) * in + i] += b[o * r * E + j * E + e] * g;
          d_b[o * r * E + j * E + e] += g * a[(e * r + j) * in + i];
        }
      }
}

std::string peft_model_key(const std::string& name) { return "base_model.model." + name; }

std::string peft_adapter_key(const LoraTarget& target, const std::vector<LoraTarget>& all_targets,
                             const std::string& a_or_b) {
  if (!target.experts) return peft_model_key(target.module + "." + a_or_b + ".weight");
  const std::string block = module_of(target.module);  // "...mlp.experts"
  // PEFT wraps the block once per targeted parameter, in registration order (gate_up_proj first):
  // the first wrapper ends up inside the second, so its keys gain ".base_layer".
  bool inner = false;
  if (ends_with(target.module, ".gate_up_proj")) {
    for (const LoraTarget& other : all_targets) inner = inner || other.module == block + ".down_proj";
  }
  return peft_model_key(block + (inner ? ".base_layer." : ".") + a_or_b + ".weight");
}

#define INSTANTIATE(T)                                                                                       \
  template void lora_delta<T>(const LoraTarget&, int64_t, const T*, const T*, double, T*);                  \
  template void lora_delta_backward<T>(const LoraTarget&, int64_t, const T*, const T*, double, const T*, T*, \
                                       T*);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace deltamoe
