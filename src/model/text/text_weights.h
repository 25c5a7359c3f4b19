// The text model's parameters as typed per-layer views (llm.c's ParameterTensors, llama.cpp's
// llama_layer): bound once from the parameter table's names, read by GpuTextModel by field.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/device_param.h"

namespace deltamoe {

struct GdnWeights {  // linear_attn.*
  DeviceParam in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias, A_log, norm, out_proj;
};

struct AttentionWeights {  // self_attn.*
  DeviceParam q_proj, k_proj, v_proj, o_proj, q_norm, k_norm;
};

struct MoeWeights {  // mlp.*
  DeviceParam gate, experts_gate_up, experts_down;
  DeviceParam shared_gate_proj, shared_up_proj, shared_down_proj, shared_expert_gate;
};

struct DecoderLayerWeights {
  DeviceParam input_layernorm, post_attention_layernorm;
  GdnWeights linear_attn;      // GDN layers
  AttentionWeights self_attn;  // full-attention layers
  MoeWeights mlp;
};

struct TextWeights {
  DeviceParam embed_tokens, norm, lm_head;
  std::vector<DecoderLayerWeights> layers;
  // True when any parameter of the text model is trained (else its backward forms input
  // gradients only, for the vision tower).
  bool any_trained() const;
};

// Whether GpuTextModel applies a LoRA adapter on this weight module: every Linear of the text
// model (attention, GDN, shared expert and its gate) and the routed experts' fused weights.
bool gpu_applies_lora_adapter(const std::string& module);

// Binds every tensor of text_param_table(config, prefix) to its field through lookup; throws naming
// a tensor the table has and the binding misses (or the other way round). lora (optional) attaches
// adapters to the weights GpuTextModel applies them on (gpu_applies_lora_adapter);
// an adapter on any other weight is refused with its name.
TextWeights bind_text_weights(const TextConfig& config, const std::string& prefix, const DeviceParamLookup& lookup,
                              const DeviceLoraLookup& lora = nullptr);

// The names of the text tensors GpuTextModel reads in fp32 (the binding's needs_f32), so an owner
// can keep fp32 values of those it does not train.
std::set<std::string> text_params_read_in_f32(const TextConfig& config, const std::string& prefix);

}  // namespace deltamoe
