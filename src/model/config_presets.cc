// Named model configurations: the two tiny test models and the released Qwen3.5-MoE sizes (the released
// models' config.json files). The tiny models' special-token ids mirror the real ones (see
// docs/checkpoints.md).
#include <string>
#include <vector>

#include "core/error.h"
#include "model/config.h"

namespace deltamoe {
namespace {

// The real specials occupy 248044..248076 (33 ids); the tiny models put the same block at the top
// of their 4096-id vocabulary, so tiny id = real id - kTinySpecialShift (248044 -> 4063).
constexpr int64_t kTinyVocab = 4096;
constexpr int64_t kRealFirstSpecial = 248044;
constexpr int64_t kNumSpecials = 33;
constexpr int64_t kTinySpecialShift = kRealFirstSpecial - (kTinyVocab - kNumSpecials);

int64_t tiny_id(int64_t real_id) { return real_id - kTinySpecialShift; }

ModelConfig tiny_text_model() {
  ModelConfig config;
  config.model_type = "qwen3_5_moe_text";
  config.has_vision = false;
  TextConfig& t = config.text;
  t.vocab_size = kTinyVocab;
  t.hidden_size = 64;
  t.num_hidden_layers = 4;
  t.layer_types = {LayerType::linear_attention, LayerType::linear_attention, LayerType::linear_attention,
                   LayerType::full_attention};
  t.num_attention_heads = 4;
  t.num_key_value_heads = 2;
  t.head_dim = 32;
  t.rope_theta = 1e7;
  t.partial_rotary_factor = 0.25;  // rotary_dim 8
  t.mrope_section = {2, 1, 1};     // sums to rotary_dim / 2
  t.max_position_embeddings = 8192;
  t.linear_conv_kernel_dim = 4;
  t.linear_num_key_heads = 2;
  t.linear_num_value_heads = 4;
  t.linear_key_head_dim = 16;
  t.linear_value_head_dim = 16;
  t.num_experts = 8;
  t.num_experts_per_tok = 2;
  t.moe_intermediate_size = 32;
  t.shared_expert_intermediate_size = 32;
  t.bos_token_id = tiny_id(248044);
  t.eos_token_id = tiny_id(248044);
  t.dtype = "bfloat16";
  config.image_token_id = tiny_id(248056);
  config.video_token_id = tiny_id(248057);
  config.vision_start_token_id = tiny_id(248053);
  config.vision_end_token_id = tiny_id(248054);
  return config;
}

ModelConfig tiny_vl_model() {
  ModelConfig config = tiny_text_model();
  config.model_type = "qwen3_5_moe";
  config.has_vision = true;
  VisionConfig& v = config.vision;
  v.depth = 2;
  v.hidden_size = 64;
  v.num_heads = 4;
  v.intermediate_size = 128;
  v.patch_size = 16;
  v.temporal_patch_size = 2;
  v.spatial_merge_size = 2;
  v.out_hidden_size = config.text.hidden_size;
  v.num_position_embeddings = 64;  // 8 x 8 grid
  return config;
}

// Values of the released Qwen3.5-35B-A3B (its config.json).
ModelConfig qwen35_35b_a3b() {
  ModelConfig config;
  TextConfig& t = config.text;
  t.vocab_size = 248320;
  t.hidden_size = 2048;
  t.num_hidden_layers = 40;
  t.num_attention_heads = 16;
  t.num_key_value_heads = 2;
  t.head_dim = 256;
  t.rope_theta = 1e7;
  t.partial_rotary_factor = 0.25;
  t.mrope_section = {11, 11, 10};
  t.max_position_embeddings = 262144;
  t.linear_num_key_heads = 16;
  t.linear_num_value_heads = 32;
  t.linear_key_head_dim = 128;
  t.linear_value_head_dim = 128;
  t.num_experts = 256;
  t.num_experts_per_tok = 8;
  t.moe_intermediate_size = 512;
  t.shared_expert_intermediate_size = 512;
  t.mtp_num_hidden_layers = 1;
  t.mtp_use_dedicated_embeddings = false;
  t.mamba_ssm_dtype = "float32";
  t.bos_token_id = 248044;
  t.eos_token_id = 248044;
  t.dtype = "bfloat16";
  t.layer_types.clear();
  for (int64_t i = 0; i < t.num_hidden_layers; ++i) {
    t.layer_types.push_back((i + 1) % 4 == 0 ? LayerType::full_attention : LayerType::linear_attention);
  }
  config.vision.out_hidden_size = t.hidden_size;
  return config;
}

// Qwen3.5-397B-A17B (its config.json's text sizes; vision tower assumed identical to the 35B one).
ModelConfig qwen35_397b_a17b() {
  ModelConfig config = qwen35_35b_a3b();
  TextConfig& t = config.text;
  t.hidden_size = 4096;
  t.num_hidden_layers = 60;
  t.num_attention_heads = 32;
  t.linear_num_value_heads = 64;
  t.num_experts = 512;
  t.num_experts_per_tok = 10;
  t.moe_intermediate_size = 1024;
  t.shared_expert_intermediate_size = 1024;
  t.layer_types.clear();
  for (int64_t i = 0; i < t.num_hidden_layers; ++i) {
    t.layer_types.push_back((i + 1) % 4 == 0 ? LayerType::full_attention : LayerType::linear_attention);
  }
  config.vision.out_hidden_size = t.hidden_size;
  return config;
}

}  // namespace

std::vector<std::string> model_config_preset_names() {
  return {"tiny", "tiny-vl", "qwen3.5-35b-a3b", "qwen3.5-397b-a17b"};
}

ModelConfig model_config_preset(const std::string& name) {
  ModelConfig config;
  if (name == "tiny") {
    config = tiny_text_model();
  } else if (name == "tiny-vl") {
    config = tiny_vl_model();
  } else if (name == "qwen3.5-35b-a3b") {
    config = qwen35_35b_a3b();
  } else if (name == "qwen3.5-397b-a17b") {
    config = qwen35_397b_a17b();
  } else {
    RAISE("unknown model preset '", name, "'; known: tiny, tiny-vl, qwen3.5-35b-a3b, qwen3.5-397b-a17b");
  }
  validate_model_config(config, "preset " + name);
  return config;
}

ModelConfig reduced_depth_config(ModelConfig config, int64_t layers, bool text_only) {
  CHECK(layers >= 1, "the model needs at least one decoder layer, got ", layers);
  TextConfig& t = config.text;
  t.num_hidden_layers = layers;
  t.layer_types.clear();
  for (int64_t i = 0; i < layers; ++i) {
    t.layer_types.push_back((i + 1) % t.full_attention_interval == 0 ? LayerType::full_attention
                                                                     : LayerType::linear_attention);
  }
  if (text_only) {
    config.has_vision = false;
    config.model_type = "qwen3_5_moe_text";
  }
  config.original_json.clear();
  return config;
}

}  // namespace deltamoe
