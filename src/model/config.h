// Model configuration of Qwen3.5-MoE (model_type qwen3_5_moe, VLM) and its text-only variant
// (qwen3_5_moe_text): every field of config.json with transformers' class defaults, the parser
// that validates it, the named presets, and the JSON writer (transformers' configuration_qwen3_5_moe.py).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace deltamoe {

enum class LayerType { linear_attention, full_attention };

// "linear_attention" / "full_attention", as config.json spells them.
const char* layer_type_name(LayerType type);

// Text tower (Qwen3_5MoeTextConfig). Defaults are transformers' class defaults.
struct TextConfig {
  int64_t vocab_size = 248320;
  int64_t hidden_size = 2048;           // H
  int64_t num_hidden_layers = 40;       // L
  std::vector<LayerType> layer_types;   // L entries; derived from full_attention_interval if absent
  int64_t full_attention_interval = 4;  // layer i is full attention iff (i+1) % interval == 0
  int64_t num_attention_heads = 16;     // Nq
  int64_t num_key_value_heads = 2;      // Nkv
  int64_t head_dim = 256;               // D
  bool attention_bias = false;
  bool attn_output_gate = true;  // not read by HF (the gate is always on); kept for the JSON
  double attention_dropout = 0.0;
  // RoPE (new layout: rope_parameters {...}; old layout: top-level rope_theta/partial_rotary_factor
  // and rope_scaling {mrope_section, mrope_interleaved}).
  std::string rope_type = "default";
  double rope_theta = 10000.0;
  double partial_rotary_factor = 0.25;
  std::vector<int64_t> mrope_section = {11, 11, 10};  // sums to rotary_dim() / 2
  bool mrope_interleaved = true;
  int64_t max_position_embeddings = 32768;
  // Gated DeltaNet.
  int64_t linear_conv_kernel_dim = 4;   // K
  int64_t linear_key_head_dim = 128;    // Dk
  int64_t linear_value_head_dim = 128;  // Dv
  int64_t linear_num_key_heads = 16;    // Hk
  int64_t linear_num_value_heads = 32;  // Hv
  // MoE (every layer).
  int64_t num_experts = 256;                      // E
  int64_t num_experts_per_tok = 8;                // k
  int64_t moe_intermediate_size = 512;            // I
  int64_t shared_expert_intermediate_size = 512;  // Is
  double router_aux_loss_coef = 0.001;
  bool output_router_logits = false;
  std::string hidden_act = "silu";
  double rms_norm_eps = 1e-6;
  double initializer_range = 0.02;
  bool tie_word_embeddings = false;
  bool use_cache = true;
  // Not read by transformers; present in the released configs and kept for other tools.
  int64_t mtp_num_hidden_layers = 0;
  bool mtp_use_dedicated_embeddings = false;
  std::string mamba_ssm_dtype;  // "" when absent
  std::optional<int64_t> bos_token_id, eos_token_id, pad_token_id;
  std::string dtype;  // "bfloat16", "float32" or "" when absent

  int64_t rotary_dim() const;                                                     // head_dim * partial_rotary_factor
  int64_t key_dim() const { return linear_num_key_heads * linear_key_head_dim; }  // Hk*Dk
  int64_t value_dim() const { return linear_num_value_heads * linear_value_head_dim; }  // Hv*Dv
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  int64_t num_layers_of(LayerType type) const;
};

// Vision tower (Qwen3_5MoeVisionConfig).
struct VisionConfig {
  int64_t depth = 27;
  int64_t hidden_size = 1152;  // Cv
  std::string hidden_act = "gelu_pytorch_tanh";
  int64_t intermediate_size = 4304;
  int64_t num_heads = 16;
  int64_t in_channels = 3;
  int64_t patch_size = 16;                        // P
  int64_t temporal_patch_size = 2;                // Tp
  int64_t spatial_merge_size = 2;                 // m
  int64_t out_hidden_size = 3584;                 // must equal the text hidden size
  int64_t num_position_embeddings = 2304;         // a square grid (48 x 48)
  std::vector<int64_t> deepstack_visual_indexes;  // always empty for Qwen3.5
  double initializer_range = 0.02;

  int64_t head_dim() const { return hidden_size / num_heads; }
  int64_t patch_dim() const { return in_channels * temporal_patch_size * patch_size * patch_size; }
  int64_t merged_dim() const { return hidden_size * spatial_merge_size * spatial_merge_size; }
};

struct ModelConfig {
  std::string model_type = "qwen3_5_moe";  // "qwen3_5_moe" (VLM) or "qwen3_5_moe_text"
  bool has_vision = true;                  // model_type == "qwen3_5_moe"
  TextConfig text;
  VisionConfig vision;  // meaningful only when has_vision
  int64_t image_token_id = 248056;
  int64_t video_token_id = 248057;
  int64_t vision_start_token_id = 248053;
  int64_t vision_end_token_id = 248054;
  bool tie_word_embeddings = false;  // top level; mirrors text.tie_word_embeddings
  // The config.json text this config was parsed from ("" for presets), so that a save writes the
  // file back unchanged (fields we do not model survive a load/save).
  std::string original_json;

  // Prefix of the text tower's keys: "model.language_model" (VLM) or "model" (text only).
  std::string text_prefix() const { return has_vision ? "model.language_model" : "model"; }
};

// Parses and validates config.json text. `where` names the source (a path) in error messages.
// Unknown model types and inconsistent values are rejected with a message naming the field.
ModelConfig parse_model_config(const std::string& json_text, const std::string& where);
// Reads and parses a config.json file (or the config.json inside a directory).
ModelConfig load_model_config_file(const std::string& path);
// Named presets: "tiny", "tiny-vl", "qwen3.5-35b-a3b", "qwen3.5-397b-a17b".
ModelConfig model_config_preset(const std::string& name);
std::vector<std::string> model_config_preset_names();
// A preset name or a path to config.json / a model directory.
ModelConfig resolve_model_config(const std::string& preset_or_path);

// The same model with `layers` decoder layers, typed as full_attention_interval says (every 4th
// full attention in Qwen3.5: [lin, lin, lin, full] repeated); text_only drops the vision tower
// (model_type qwen3_5_moe_text). For benchmarks and reduced-depth runs at full widths.
ModelConfig reduced_depth_config(ModelConfig config, int64_t layers, bool text_only);
// Checks the cross-field rules (heads divide, mrope_section sums, ...); throws naming the field.
void validate_model_config(const ModelConfig& config, const std::string& where);
// config.json for `config`, generated from the fields (not original_json), new rope layout.
std::string model_config_to_json(const ModelConfig& config);
// preprocessor_config.json for a VLM (Qwen3.5 values, patch/merge sizes from the config).
std::string preprocessor_config_json(const ModelConfig& config);

}  // namespace deltamoe
