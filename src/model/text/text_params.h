// Parameters and gradients of the text tower as fp32 host tensors keyed by their Hugging Face
// names (fused expert layout), the list of names and shapes the text model needs, and lookups
// that fail with the parameter's name when something is missing or mis-shaped.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"

namespace deltamoe {

struct ParamTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;  // row-major, numel(shape) entries
};
using ParamMap = std::map<std::string, ParamTensor>;

struct NamedShape {
  std::string name;
  std::vector<int64_t> shape;
};

// Every trainable tensor of the text tower in the fused in-memory layout. `prefix` is the text
// tower's key prefix ("model" for qwen3_5_moe_text, "model.language_model" for qwen3_5_moe);
// lm_head.weight has no prefix.
std::vector<NamedShape> text_param_shapes(const TextConfig& config, const std::string& prefix);

// "<prefix>.layers.<i>." — the start of decoder layer i's names.
std::string layer_prefix(const std::string& prefix, int64_t layer_idx);

// The rotary width of the attention heads: head_dim * partial_rotary_factor (truncated, as HF).
int64_t text_rotary_dim(const TextConfig& config);

// Throws, naming the tensor, unless `params` holds every name of text_param_shapes with its shape.
void check_text_params(const ParamMap& params, const TextConfig& config, const std::string& prefix);

// The values of `name`; throws naming the tensor when it is absent.
const float* param_values(const ParamMap& params, const std::string& name);
float* param_values(ParamMap& params, const std::string& name);

// A map with the same names and shapes, all zeros (gradient accumulators).
ParamMap zeros_like(const ParamMap& params);

// Weight-gradient products the text backward asked the kernels for (computed) or left out because
// the weights are frozen (skipped), with the weight values they cover. Per thread; tests reset and
// read it to check that freezing removes that work without relying on timing.
struct WeightGradCounts {
  int64_t computed = 0, skipped = 0;
  int64_t computed_values = 0, skipped_values = 0;
};
WeightGradCounts& weight_grad_counts();

// Where one layer's backward puts its parameter gradients. grads null means frozen weights: then
// `of` is null for every name, which each CPU reference backward reads as "weight gradient not
// needed" and skips that work (no throwaway buffers); a name grads does not hold is frozen the same
// way (LoRA: the base weights, while their adapters are trained). Every call is tallied in
// weight_grad_counts.
class LayerGrads {
 public:
  LayerGrads(const ParamMap& params, ParamMap* grads) : params_(params), grads_(grads) {}
  float* of(const std::string& name) const;

 private:
  const ParamMap& params_;
  ParamMap* grads_;
};

// Random parameters for tests: matrices normal(0, matrix_std), zero-centred norm weights
// normal(0, 0.3), the GDN norm weight 1 + normal(0, 0.3), A_log and dt_bias normal(0, 0.5).
ParamMap random_text_params(const TextConfig& config, const std::string& prefix, uint64_t seed,
                            double matrix_std = 0.15);

}  // namespace deltamoe
