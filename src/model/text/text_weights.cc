// bind_text_weights: the one place where the GPU text model's fields meet the tensor names.
#include "model/text/text_weights.h"

#include <functional>

#include "core/error.h"
#include "model/param_table.h"
#include "model/text/text_params.h"

namespace deltamoe {

bool TextWeights::any_trained() const {
  bool trained = embed_tokens.trained() || norm.trained() || lm_head.trained();
  for (const DecoderLayerWeights& l : layers) {
    // A trained LoRA adapter on a projection trains the text model as well (its base frozen).
    for (const DeviceParam* p : {&l.linear_attn.in_proj_qkv, &l.linear_attn.in_proj_z, &l.linear_attn.in_proj_b,
                                 &l.linear_attn.in_proj_a, &l.linear_attn.out_proj, &l.self_attn.q_proj,
                                 &l.self_attn.k_proj, &l.self_attn.v_proj, &l.self_attn.o_proj,
                                 &l.mlp.experts_gate_up, &l.mlp.experts_down, &l.mlp.shared_gate_proj,
                                 &l.mlp.shared_up_proj, &l.mlp.shared_down_proj, &l.mlp.shared_expert_gate})
      trained = trained || p->lora.grad_a != nullptr;
    for (const DeviceParam* p : {&l.input_layernorm, &l.post_attention_layernorm, &l.mlp.gate,
                                 &l.mlp.experts_gate_up, &l.mlp.experts_down, &l.mlp.shared_gate_proj,
                                 &l.mlp.shared_up_proj, &l.mlp.shared_down_proj, &l.mlp.shared_expert_gate,
                                 &l.linear_attn.in_proj_qkv, &l.linear_attn.out_proj, &l.self_attn.q_proj,
                                 &l.self_attn.o_proj})
      trained = trained || p->trained();
  }
  return trained;
}

namespace {

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

// The weights GpuTextModel applies adapters on: its projection funnel (gpu_text_model_step.cc), the
// shared expert's kernel and the routed experts' grouped products. Every nn.Linear of the text
// model (all-linear) and the fused expert weights; the router, conv1d, embeddings and norms have none.
bool gpu_applies_lora_adapter(const std::string& module) {
  for (const char* name : {".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.o_proj",
                           ".linear_attn.in_proj_qkv", ".linear_attn.in_proj_z", ".linear_attn.in_proj_b",
                           ".linear_attn.in_proj_a", ".linear_attn.out_proj", ".mlp.experts.gate_up_proj",
                           ".mlp.experts.down_proj", ".mlp.shared_expert.gate_proj", ".mlp.shared_expert.up_proj",
                           ".mlp.shared_expert.down_proj", ".mlp.shared_expert_gate"}) {
    if (ends_with(module, name)) return true;
  }
  return false;
}

TextWeights bind_text_weights(const TextConfig& config, const std::string& prefix, const DeviceParamLookup& lookup,
                              const DeviceLoraLookup& lora) {
  std::set<std::string> bound;
  auto get = [&](const std::string& name, bool needs_f32) {
    bound.insert(name);
    DeviceParam param = lookup(name, needs_f32);
    if (lora) {
      // A Linear's adapter is keyed by its module, a fused expert weight's by the parameter itself.
      const std::string module = ends_with(name, ".weight") ? name.substr(0, name.size() - 7) : name;
      const DeviceLoraViews views = lora(module);
      if (views.attached()) {
        CHECK(gpu_applies_lora_adapter(module), "gpu text model: a LoRA adapter on '", module, "', which is not a ",
              "Linear of the text model nor a routed experts' fused weight (the GPU model applies adapters to ",
              "q/k/v/o_proj, in_proj_qkv/z/b/a, out_proj, the shared expert's gate/up/down_proj, ",
              "shared_expert_gate and mlp.experts.gate_up_proj / down_proj)");
        CHECK(views.a != nullptr && views.b != nullptr, "gpu text model: the adapter of '", module, "' lacks A or B");
        param.lora = views;
      }
    }
    return param;
  };
  TextWeights w;
  w.embed_tokens = get(prefix + ".embed_tokens.weight", true);  // rows copied into the fp32 stream
  w.norm = get(prefix + ".norm.weight", true);
  w.lm_head = get("lm_head.weight", false);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    const std::string p = layer_prefix(prefix, i);
    DecoderLayerWeights l;
    l.input_layernorm = get(p + "input_layernorm.weight", true);
    l.post_attention_layernorm = get(p + "post_attention_layernorm.weight", true);
    if (config.layer_types[static_cast<size_t>(i)] == LayerType::linear_attention) {
      const std::string g = p + "linear_attn.";
      GdnWeights& d = l.linear_attn;
      d.in_proj_qkv = get(g + "in_proj_qkv.weight", false);
      d.in_proj_z = get(g + "in_proj_z.weight", false);
      d.in_proj_b = get(g + "in_proj_b.weight", false);
      d.in_proj_a = get(g + "in_proj_a.weight", false);
      d.conv1d = get(g + "conv1d.weight", false);
      d.dt_bias = get(g + "dt_bias", true);
      d.A_log = get(g + "A_log", true);
      d.norm = get(g + "norm.weight", true);
      d.out_proj = get(g + "out_proj.weight", false);
    } else {
      const std::string a = p + "self_attn.";
      AttentionWeights& d = l.self_attn;
      d.q_proj = get(a + "q_proj.weight", false);
      d.k_proj = get(a + "k_proj.weight", false);
      d.v_proj = get(a + "v_proj.weight", false);
      d.o_proj = get(a + "o_proj.weight", false);
      d.q_norm = get(a + "q_norm.weight", true);
      d.k_norm = get(a + "k_norm.weight", true);
    }
    const std::string m = p + "mlp.";
    MoeWeights& e = l.mlp;
    e.gate = get(m + "gate.weight", true);  // split into hi/lo bf16 halves from fp32 (the router runs at fp32 precision)
    e.experts_gate_up = get(m + "experts.gate_up_proj", false);
    e.experts_down = get(m + "experts.down_proj", false);
    e.shared_gate_proj = get(m + "shared_expert.gate_proj.weight", false);
    e.shared_up_proj = get(m + "shared_expert.up_proj.weight", false);
    e.shared_down_proj = get(m + "shared_expert.down_proj.weight", false);
    e.shared_expert_gate = get(m + "shared_expert_gate.weight", false);
    w.layers.push_back(l);
  }
  // The binding covers the parameter table exactly (a new tensor in the table must get a field).
  for (const ParamSpec& spec : text_param_table(config, prefix, true)) {
    CHECK(bound.count(spec.name) == 1, "gpu text model: the parameter table has '", spec.name,
          "', which no field of TextWeights binds");
  }
  CHECK(bound.size() == text_param_table(config, prefix, true).size(), "gpu text model: ", bound.size(),
        " tensors bound, the parameter table has ", text_param_table(config, prefix, true).size());
  return w;
}

std::set<std::string> text_params_read_in_f32(const TextConfig& config, const std::string& prefix) {
  std::set<std::string> names;
  bind_text_weights(config, prefix, [&](const std::string& name, bool needs_f32) {
    if (needs_f32) names.insert(name);
    return DeviceParam{};
  });
  return names;
}

}  // namespace deltamoe
