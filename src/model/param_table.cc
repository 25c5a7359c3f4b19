// The parameter table of Qwen3.5-MoE (the released checkpoints' tensor names and shapes) and parameter counts.
#include "model/param_table.h"

#include "core/error.h"

namespace deltamoe {
namespace {

class TableBuilder {
 public:
  TableBuilder(std::vector<ParamSpec>* table, DType dtype) : table_(table), dtype_(dtype) {}

  void add(std::string name, Shape shape, Component component, InitKind init, int layer_idx = -1) {
    ParamSpec spec;
    spec.name = std::move(name);
    spec.shape = shape;
    // The released checkpoints keep A_log in fp32; everything else follows the model dtype.
    spec.dtype = init == InitKind::a_log ? DType::f32 : dtype_;
    spec.component = component;
    spec.init = init;
    spec.layer_idx = layer_idx;
    table_->push_back(std::move(spec));
  }
  // A Linear layer: weight [out, in] (normal) and optionally bias [out] (zeros).
  void linear(const std::string& prefix, int64_t out, int64_t in, bool bias, Component component, int layer_idx) {
    add(prefix + ".weight", {out, in}, component, InitKind::normal, layer_idx);
    if (bias) add(prefix + ".bias", {out}, component, InitKind::zeros, layer_idx);
  }
  // A LayerNorm: weight ones, bias zeros.
  void layer_norm(const std::string& prefix, int64_t dim, Component component, int layer_idx) {
    add(prefix + ".weight", {dim}, component, InitKind::ones, layer_idx);
    add(prefix + ".bias", {dim}, component, InitKind::zeros, layer_idx);
  }

 private:
  std::vector<ParamSpec>* table_;
  DType dtype_;
};

void add_gdn(TableBuilder& b, const TextConfig& t, const std::string& p, int i) {
  const int64_t H = t.hidden_size, Hv = t.linear_num_value_heads;
  b.linear(p + "in_proj_qkv", t.conv_dim(), H, false, Component::gdn, i);
  b.linear(p + "in_proj_z", t.value_dim(), H, false, Component::gdn, i);
  b.linear(p + "in_proj_b", Hv, H, false, Component::gdn, i);
  b.linear(p + "in_proj_a", Hv, H, false, Component::gdn, i);
  b.add(p + "conv1d.weight", {t.conv_dim(), 1, t.linear_conv_kernel_dim}, Component::gdn, InitKind::normal, i);
  b.add(p + "dt_bias", {Hv}, Component::gdn, InitKind::ones, i);
  b.add(p + "A_log", {Hv}, Component::gdn, InitKind::a_log, i);
  // The gated RMSNorm is plain (weight multiplies), so it starts at one, unlike the (1 + w) norms.
  b.add(p + "norm.weight", {t.linear_value_head_dim}, Component::gdn, InitKind::ones, i);
  b.linear(p + "out_proj", H, t.value_dim(), false, Component::gdn, i);
}

void add_attention(TableBuilder& b, const TextConfig& t, const std::string& p, int i) {
  const int64_t H = t.hidden_size, D = t.head_dim;
  // q_proj holds query and output gate interleaved per head: [2 * Nq * D, H].
  b.linear(p + "q_proj", 2 * t.num_attention_heads * D, H, t.attention_bias, Component::attention, i);
  b.linear(p + "k_proj", t.num_key_value_heads * D, H, t.attention_bias, Component::attention, i);
  b.linear(p + "v_proj", t.num_key_value_heads * D, H, t.attention_bias, Component::attention, i);
  b.linear(p + "o_proj", H, t.num_attention_heads * D, t.attention_bias, Component::attention, i);
  b.add(p + "q_norm.weight", {D}, Component::attention, InitKind::zeros, i);
  b.add(p + "k_norm.weight", {D}, Component::attention, InitKind::zeros, i);
}

void add_moe(TableBuilder& b, const TextConfig& t, const std::string& p, int i) {
  const int64_t H = t.hidden_size, E = t.num_experts, I = t.moe_intermediate_size;
  b.linear(p + "gate", E, H, false, Component::router_shared, i);
  b.add(p + "experts.gate_up_proj", {E, 2 * I, H}, Component::routed_experts, InitKind::normal, i);
  b.add(p + "experts.down_proj", {E, H, I}, Component::routed_experts, InitKind::normal, i);
  const int64_t Is = t.shared_expert_intermediate_size;
  b.linear(p + "shared_expert.gate_proj", Is, H, false, Component::router_shared, i);
  b.linear(p + "shared_expert.up_proj", Is, H, false, Component::router_shared, i);
  b.linear(p + "shared_expert.down_proj", H, Is, false, Component::router_shared, i);
  b.linear(p + "shared_expert_gate", 1, H, false, Component::router_shared, i);
}

void add_vision(TableBuilder& b, const VisionConfig& v, const std::string& prefix) {
  const std::string q = prefix + ".";
  const int64_t C = v.hidden_size;
  b.add(q + "patch_embed.proj.weight", {C, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size},
        Component::vision, InitKind::normal);
  b.add(q + "patch_embed.proj.bias", {C}, Component::vision, InitKind::zeros);
  b.add(q + "pos_embed.weight", {v.num_position_embeddings, C}, Component::vision, InitKind::normal);
  for (int j = 0; j < static_cast<int>(v.depth); ++j) {
    const std::string p = q + "blocks." + std::to_string(j) + ".";
    b.layer_norm(p + "norm1", C, Component::vision, j);
    b.layer_norm(p + "norm2", C, Component::vision, j);
    b.linear(p + "attn.qkv", 3 * C, C, true, Component::vision, j);
    b.linear(p + "attn.proj", C, C, true, Component::vision, j);
    b.linear(p + "mlp.linear_fc1", v.intermediate_size, C, true, Component::vision, j);
    b.linear(p + "mlp.linear_fc2", C, v.intermediate_size, true, Component::vision, j);
  }
  b.layer_norm(q + "merger.norm", C, Component::vision, -1);
  b.linear(q + "merger.linear_fc1", v.merged_dim(), v.merged_dim(), true, Component::vision, -1);
  b.linear(q + "merger.linear_fc2", v.out_hidden_size, v.merged_dim(), true, Component::vision, -1);
}

std::string layer_prefix(const ModelConfig& config, int layer_idx) {
  return config.text_prefix() + ".layers." + std::to_string(layer_idx) + ".";
}

}  // namespace

const char* component_name(Component component) {
  switch (component) {
    case Component::embedding: return "embed/lm_head";
    case Component::gdn: return "GDN";
    case Component::attention: return "attention";
    case Component::routed_experts: return "routed experts";
    case Component::router_shared: return "router+shared";
    case Component::norm: return "norms";
    case Component::vision: return "vision";
  }
  return "?";
}

std::string fused_gate_up_name(const ModelConfig& config, int layer_idx) {
  return layer_prefix(config, layer_idx) + "mlp.experts.gate_up_proj";
}
std::string fused_down_name(const ModelConfig& config, int layer_idx) {
  return layer_prefix(config, layer_idx) + "mlp.experts.down_proj";
}
std::string per_expert_name(const ModelConfig& config, int layer_idx, int64_t expert_idx, const char* part) {
  return layer_prefix(config, layer_idx) + "mlp.experts." + std::to_string(expert_idx) + "." + part + ".weight";
}

void check_model_dtype(DType dtype) {
  CHECK(dtype == DType::bf16 || dtype == DType::f32 || dtype == DType::f16,
        "model dtype must be bf16, f16 or f32, got ", dtype_name(dtype));
}

std::vector<ParamSpec> text_param_table(const TextConfig& t, const std::string& prefix, bool with_lm_head,
                                        DType dtype) {
  check_model_dtype(dtype);
  CHECK(static_cast<int64_t>(t.layer_types.size()) == t.num_hidden_layers, "text config: layer_types has ",
        t.layer_types.size(), " entries for num_hidden_layers = ", t.num_hidden_layers);
  std::vector<ParamSpec> table;
  TableBuilder b(&table, dtype);
  b.add(prefix + ".embed_tokens.weight", {t.vocab_size, t.hidden_size}, Component::embedding, InitKind::normal);
  for (int i = 0; i < static_cast<int>(t.num_hidden_layers); ++i) {
    const std::string p = str_cat(prefix, ".layers.", i, ".");
    // Zero-centred RMSNorms scale by (1 + w), so zeros are the identity.
    b.add(p + "input_layernorm.weight", {t.hidden_size}, Component::norm, InitKind::zeros, i);
    b.add(p + "post_attention_layernorm.weight", {t.hidden_size}, Component::norm, InitKind::zeros, i);
    if (t.layer_types[i] == LayerType::linear_attention) {
      add_gdn(b, t, p + "linear_attn.", i);
    } else {
      add_attention(b, t, p + "self_attn.", i);
    }
    add_moe(b, t, p + "mlp.", i);
  }
  b.add(prefix + ".norm.weight", {t.hidden_size}, Component::norm, InitKind::zeros);
  if (with_lm_head) b.add("lm_head.weight", {t.vocab_size, t.hidden_size}, Component::embedding, InitKind::normal);
  return table;
}

std::vector<ParamSpec> vision_param_table(const VisionConfig& vision, const std::string& prefix, DType dtype) {
  check_model_dtype(dtype);
  std::vector<ParamSpec> table;
  TableBuilder b(&table, dtype);
  add_vision(b, vision, prefix);
  return table;
}

std::vector<ParamSpec> build_param_table(const ModelConfig& config, DType dtype) {
  std::vector<ParamSpec> table =
      text_param_table(config.text, config.text_prefix(), !config.tie_word_embeddings, dtype);
  if (config.has_vision) {
    for (ParamSpec& spec : vision_param_table(config.vision, "model.visual", dtype)) table.push_back(std::move(spec));
  }
  return table;
}

ParamCounts count_params(const ModelConfig& config) {
  ParamCounts counts;
  const TextConfig& t = config.text;
  const std::string embed_name = config.text_prefix() + ".embed_tokens.weight";
  int64_t embed_tokens = 0;
  for (const ParamSpec& spec : build_param_table(config)) {
    int64_t n = spec.shape.numel();
    counts.total += n;
    counts.by_component[static_cast<int>(spec.component)] += n;
    if (spec.name == embed_name) embed_tokens = n;
  }
  const int64_t vision = counts.by_component[static_cast<int>(Component::vision)];
  const int64_t routed = counts.by_component[static_cast<int>(Component::routed_experts)];
  counts.text_total = counts.total - vision;
  // Each token runs k of the E routed experts; every other text parameter (but the lookup) is used.
  const int64_t routed_active = routed / t.num_experts * t.num_experts_per_tok;
  counts.active_per_token = counts.text_total - routed + routed_active - embed_tokens;
  counts.active_per_token_with_embedding = counts.active_per_token + embed_tokens;
  return counts;
}

}  // namespace deltamoe
