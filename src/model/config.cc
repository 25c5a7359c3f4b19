// Parsing, validation and JSON writing of Qwen3.5-MoE config.json (transformers' configuration_qwen3_5_moe.py).
#include "model/config.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "model/config_json_reader.h"

namespace deltamoe {
namespace {

using nlohmann::json;

constexpr const char* kVlmType = "qwen3_5_moe";
constexpr const char* kTextType = "qwen3_5_moe_text";
constexpr const char* kVisionType = "qwen3_5_moe_vision";

std::vector<LayerType> default_layer_types(int64_t num_layers, int64_t interval) {
  std::vector<LayerType> types;
  for (int64_t i = 0; i < num_layers; ++i) {
    types.push_back((i + 1) % interval == 0 ? LayerType::full_attention : LayerType::linear_attention);
  }
  return types;
}

// Reads the RoPE fields. Old configs put rope_theta / partial_rotary_factor at the top level and
// mrope_section in rope_scaling; new ones nest everything in rope_parameters (which wins).
void parse_rope(const JsonFieldReader& reader, TextConfig* text) {
  text->rope_theta = reader.get_double("rope_theta", text->rope_theta);
  text->partial_rotary_factor = reader.get_double("partial_rotary_factor", text->partial_rotary_factor);
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    const json* rope = reader.get_object(key);
    if (rope == nullptr) continue;
    JsonFieldReader nested(*rope, reader.where(), reader.field(key));
    // Old configs spell the type "type"; "mrope" there means plain multimodal RoPE.
    std::string type = nested.get_string("type", text->rope_type);
    type = nested.get_string("rope_type", type);
    CHECK(type == "default" || type == "mrope", reader.where(), ": ", nested.field("rope_type"), " '", type,
          "' is not supported (Qwen3.5 uses 'default'; scaled RoPE variants are not implemented)");
    text->rope_type = "default";
    text->rope_theta = nested.get_double("rope_theta", text->rope_theta);
    text->partial_rotary_factor = nested.get_double("partial_rotary_factor", text->partial_rotary_factor);
    text->mrope_section = nested.get_int_list("mrope_section", text->mrope_section);
    text->mrope_interleaved = nested.get_bool("mrope_interleaved", text->mrope_interleaved);
  }
}

TextConfig parse_text_config(const json& object, const std::string& where, const std::string& path) {
  JsonFieldReader r(object, where, path);
  TextConfig t;
  t.vocab_size = r.get_int("vocab_size", t.vocab_size);
  t.hidden_size = r.get_int("hidden_size", t.hidden_size);
  t.num_hidden_layers = r.get_int("num_hidden_layers", t.num_hidden_layers);
  t.full_attention_interval = r.get_int("full_attention_interval", t.full_attention_interval);
  t.num_attention_heads = r.get_int("num_attention_heads", t.num_attention_heads);
  t.num_key_value_heads = r.get_int("num_key_value_heads", t.num_key_value_heads);
  t.head_dim = r.get_int("head_dim", t.head_dim);
  t.attention_bias = r.get_bool("attention_bias", t.attention_bias);
  t.attn_output_gate = r.get_bool("attn_output_gate", t.attn_output_gate);
  t.attention_dropout = r.get_double("attention_dropout", t.attention_dropout);
  parse_rope(r, &t);
  t.max_position_embeddings = r.get_int("max_position_embeddings", t.max_position_embeddings);
  t.linear_conv_kernel_dim = r.get_int("linear_conv_kernel_dim", t.linear_conv_kernel_dim);
  t.linear_key_head_dim = r.get_int("linear_key_head_dim", t.linear_key_head_dim);
  t.linear_value_head_dim = r.get_int("linear_value_head_dim", t.linear_value_head_dim);
  t.linear_num_key_heads = r.get_int("linear_num_key_heads", t.linear_num_key_heads);
  t.linear_num_value_heads = r.get_int("linear_num_value_heads", t.linear_num_value_heads);
  t.num_experts = r.get_int("num_experts", t.num_experts);
  t.num_experts_per_tok = r.get_int("num_experts_per_tok", t.num_experts_per_tok);
  t.moe_intermediate_size = r.get_int("moe_intermediate_size", t.moe_intermediate_size);
  t.shared_expert_intermediate_size = r.get_int("shared_expert_intermediate_size", t.shared_expert_intermediate_size);
  t.router_aux_loss_coef = r.get_double("router_aux_loss_coef", t.router_aux_loss_coef);
  t.output_router_logits = r.get_bool("output_router_logits", t.output_router_logits);
  t.hidden_act = r.get_string("hidden_act", t.hidden_act);
  t.rms_norm_eps = r.get_double("rms_norm_eps", t.rms_norm_eps);
  t.initializer_range = r.get_double("initializer_range", t.initializer_range);
  t.tie_word_embeddings = r.get_bool("tie_word_embeddings", t.tie_word_embeddings);
  t.use_cache = r.get_bool("use_cache", t.use_cache);
  t.mtp_num_hidden_layers = r.get_int("mtp_num_hidden_layers", t.mtp_num_hidden_layers, 0);
  t.mtp_use_dedicated_embeddings = r.get_bool("mtp_use_dedicated_embeddings", t.mtp_use_dedicated_embeddings);
  t.mamba_ssm_dtype = r.get_string("mamba_ssm_dtype", t.mamba_ssm_dtype);
  t.bos_token_id = r.get_optional_int("bos_token_id");
  t.eos_token_id = r.get_optional_int("eos_token_id");
  t.pad_token_id = r.get_optional_int("pad_token_id");
  t.dtype = r.get_string("dtype", r.get_string("torch_dtype", t.dtype));

  if (r.has("layer_types")) {
    const json& list = object.at("layer_types");
    CHECK(list.is_array(), where, ": ", r.field("layer_types"), " must be a list of strings, got ", list.dump());
    for (size_t i = 0; i < list.size(); ++i) {
      const json& item = list[i];
      std::string name = item.is_string() ? item.get<std::string>() : item.dump();
      if (name == "linear_attention") {
        t.layer_types.push_back(LayerType::linear_attention);
      } else if (name == "full_attention") {
        t.layer_types.push_back(LayerType::full_attention);
      } else {
        RAISE(where, ": ", r.field("layer_types"), "[", i, "] is '", name,
              "'; expected 'linear_attention' or 'full_attention'");
      }
    }
  } else {
    t.layer_types = default_layer_types(t.num_hidden_layers, t.full_attention_interval);
  }
  return t;
}

VisionConfig parse_vision_config(const json& object, const std::string& where, const std::string& path) {
  JsonFieldReader r(object, where, path);
  std::string type = r.get_string("model_type", kVisionType);
  // Older checkpoints wrote the parent's model type here; transformers rewrites it the same way.
  CHECK(type == kVisionType || type == kVlmType, where, ": ", r.field("model_type"), " is '", type, "'; expected '",
        kVisionType, "'");
  VisionConfig v;
  v.depth = r.get_int("depth", v.depth);
  v.hidden_size = r.get_int("hidden_size", v.hidden_size);
  v.hidden_act = r.get_string("hidden_act", v.hidden_act);
  v.intermediate_size = r.get_int("intermediate_size", v.intermediate_size);
  v.num_heads = r.get_int("num_heads", v.num_heads);
  v.in_channels = r.get_int("in_channels", v.in_channels);
  v.patch_size = r.get_int("patch_size", v.patch_size);
  v.temporal_patch_size = r.get_int("temporal_patch_size", v.temporal_patch_size);
  v.spatial_merge_size = r.get_int("spatial_merge_size", v.spatial_merge_size);
  v.out_hidden_size = r.get_int("out_hidden_size", v.out_hidden_size);
  v.num_position_embeddings = r.get_int("num_position_embeddings", v.num_position_embeddings);
  v.deepstack_visual_indexes = r.get_int_list("deepstack_visual_indexes", v.deepstack_visual_indexes);
  v.initializer_range = r.get_double("initializer_range", v.initializer_range);
  return v;
}

void validate_text(const TextConfig& t, const std::string& where, const std::string& prefix) {
  auto field = [&](const char* name) { return prefix.empty() ? std::string(name) : prefix + "." + name; };
  CHECK(t.num_attention_heads % t.num_key_value_heads == 0, where, ": ", field("num_attention_heads"), " (",
        t.num_attention_heads, ") must be a multiple of ", field("num_key_value_heads"), " (", t.num_key_value_heads,
        ")");
  CHECK(t.linear_num_value_heads % t.linear_num_key_heads == 0, where, ": ", field("linear_num_value_heads"), " (",
        t.linear_num_value_heads, ") must be a multiple of ", field("linear_num_key_heads"), " (",
        t.linear_num_key_heads, ")");
  CHECK(static_cast<int64_t>(t.layer_types.size()) == t.num_hidden_layers, where, ": ", field("layer_types"), " has ",
        t.layer_types.size(), " entries but ", field("num_hidden_layers"), " is ", t.num_hidden_layers);
  CHECK(t.num_experts_per_tok <= t.num_experts, where, ": ", field("num_experts_per_tok"), " (", t.num_experts_per_tok,
        ") exceeds ", field("num_experts"), " (", t.num_experts, ")");
  double rotary = static_cast<double>(t.head_dim) * t.partial_rotary_factor;
  CHECK(t.partial_rotary_factor > 0 && t.partial_rotary_factor <= 1 && rotary == std::floor(rotary) &&
            static_cast<int64_t>(rotary) % 2 == 0,
        where, ": ", field("partial_rotary_factor"), " (", t.partial_rotary_factor, ") times ", field("head_dim"), " (",
        t.head_dim, ") must be an even whole number of rotary channels, got ", rotary);
  CHECK(t.mrope_section.size() == 3, where, ": ", field("rope_parameters.mrope_section"),
        " must have 3 entries (t, h, w), got ", t.mrope_section.size());
  int64_t section_sum = 0;
  for (int64_t section : t.mrope_section) {
    CHECK(section >= 0, where, ": ", field("rope_parameters.mrope_section"), " has a negative entry ", section);
    section_sum += section;
  }
  CHECK(section_sum * 2 == t.rotary_dim(), where, ": ", field("rope_parameters.mrope_section"), " sums to ",
        section_sum, " but must sum to rotary_dim/2 = ", t.rotary_dim() / 2, " (head_dim ", t.head_dim,
        " x partial_rotary_factor ", t.partial_rotary_factor, " / 2)");
  CHECK(t.hidden_act == "silu", where, ": ", field("hidden_act"), " '", t.hidden_act, "' is not supported (only silu)");
  CHECK(t.rms_norm_eps > 0, where, ": ", field("rms_norm_eps"), " must be positive, got ", t.rms_norm_eps);
  CHECK(t.initializer_range > 0, where, ": ", field("initializer_range"), " must be positive");
  CHECK(t.rope_theta > 0, where, ": ", field("rope_parameters.rope_theta"), " must be positive");
  for (const auto& [name, id] : {std::pair{"bos_token_id", t.bos_token_id}, std::pair{"eos_token_id", t.eos_token_id},
                                 std::pair{"pad_token_id", t.pad_token_id}}) {
    CHECK(!id || (*id >= 0 && *id < t.vocab_size), where, ": ", field(name), " (", id.value_or(0),
          ") is outside the vocabulary [0, ", t.vocab_size, ")");
  }
}

void validate_vision(const VisionConfig& v, int64_t text_hidden, const std::string& where) {
  CHECK(v.hidden_size % v.num_heads == 0, where, ": vision_config.hidden_size (", v.hidden_size,
        ") must be a multiple of vision_config.num_heads (", v.num_heads, ")");
  CHECK(v.head_dim() % 4 == 0, where, ": vision_config.hidden_size / num_heads = ", v.head_dim(),
        " must be a multiple of 4 (2-D rotary embedding over rows and columns)");
  int64_t side = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(v.num_position_embeddings))));
  CHECK(side * side == v.num_position_embeddings, where, ": vision_config.num_position_embeddings (",
        v.num_position_embeddings, ") must be a square number (a side x side grid)");
  CHECK(v.out_hidden_size == text_hidden, where, ": vision_config.out_hidden_size (", v.out_hidden_size,
        ") must equal text_config.hidden_size (", text_hidden, "): merged image features replace token embeddings");
  CHECK(v.deepstack_visual_indexes.empty(), where,
        ": vision_config.deepstack_visual_indexes must be empty (Qwen3.5 has no deepstack mergers)");
  CHECK(v.hidden_act == "gelu_pytorch_tanh", where, ": vision_config.hidden_act '", v.hidden_act,
        "' is not supported (only gelu_pytorch_tanh)");
}

json rope_parameters_json(const TextConfig& t) {
  json rope = json::object();
  rope["rope_type"] = t.rope_type;
  rope["rope_theta"] = t.rope_theta;
  rope["partial_rotary_factor"] = t.partial_rotary_factor;
  rope["mrope_section"] = t.mrope_section;
  rope["mrope_interleaved"] = t.mrope_interleaved;
  return rope;
}

nlohmann::ordered_json text_config_json(const TextConfig& t, const char* model_type) {
  nlohmann::ordered_json out;
  out["model_type"] = model_type;
  out["vocab_size"] = t.vocab_size;
  out["hidden_size"] = t.hidden_size;
  out["num_hidden_layers"] = t.num_hidden_layers;
  std::vector<std::string> types;
  for (LayerType type : t.layer_types) types.push_back(layer_type_name(type));
  out["layer_types"] = types;
  out["full_attention_interval"] = t.full_attention_interval;
  out["num_attention_heads"] = t.num_attention_heads;
  out["num_key_value_heads"] = t.num_key_value_heads;
  out["head_dim"] = t.head_dim;
  out["attention_bias"] = t.attention_bias;
  out["attn_output_gate"] = t.attn_output_gate;
  out["attention_dropout"] = t.attention_dropout;
  out["rope_parameters"] = rope_parameters_json(t);
  out["max_position_embeddings"] = t.max_position_embeddings;
  out["linear_conv_kernel_dim"] = t.linear_conv_kernel_dim;
  out["linear_key_head_dim"] = t.linear_key_head_dim;
  out["linear_value_head_dim"] = t.linear_value_head_dim;
  out["linear_num_key_heads"] = t.linear_num_key_heads;
  out["linear_num_value_heads"] = t.linear_num_value_heads;
  out["num_experts"] = t.num_experts;
  out["num_experts_per_tok"] = t.num_experts_per_tok;
  out["moe_intermediate_size"] = t.moe_intermediate_size;
  out["shared_expert_intermediate_size"] = t.shared_expert_intermediate_size;
  out["router_aux_loss_coef"] = t.router_aux_loss_coef;
  out["output_router_logits"] = t.output_router_logits;
  out["hidden_act"] = t.hidden_act;
  out["rms_norm_eps"] = t.rms_norm_eps;
  out["initializer_range"] = t.initializer_range;
  out["tie_word_embeddings"] = t.tie_word_embeddings;
  out["use_cache"] = t.use_cache;
  if (t.mtp_num_hidden_layers > 0) {
    out["mtp_num_hidden_layers"] = t.mtp_num_hidden_layers;
    out["mtp_use_dedicated_embeddings"] = t.mtp_use_dedicated_embeddings;
  }
  if (!t.mamba_ssm_dtype.empty()) out["mamba_ssm_dtype"] = t.mamba_ssm_dtype;
  if (t.bos_token_id) out["bos_token_id"] = *t.bos_token_id;
  if (t.eos_token_id) out["eos_token_id"] = *t.eos_token_id;
  out["pad_token_id"] = t.pad_token_id ? json(*t.pad_token_id) : json(nullptr);
  if (!t.dtype.empty()) out["dtype"] = t.dtype;
  return out;
}

nlohmann::ordered_json vision_config_json(const VisionConfig& v) {
  nlohmann::ordered_json out;
  out["model_type"] = kVisionType;
  out["depth"] = v.depth;
  out["hidden_size"] = v.hidden_size;
  out["hidden_act"] = v.hidden_act;
  out["intermediate_size"] = v.intermediate_size;
  out["num_heads"] = v.num_heads;
  out["in_channels"] = v.in_channels;
  out["patch_size"] = v.patch_size;
  out["temporal_patch_size"] = v.temporal_patch_size;
  out["spatial_merge_size"] = v.spatial_merge_size;
  out["out_hidden_size"] = v.out_hidden_size;
  out["num_position_embeddings"] = v.num_position_embeddings;
  out["deepstack_visual_indexes"] = v.deepstack_visual_indexes;
  out["initializer_range"] = v.initializer_range;
  return out;
}

}  // namespace

const char* layer_type_name(LayerType type) {
  return type == LayerType::full_attention ? "full_attention" : "linear_attention";
}

int64_t TextConfig::rotary_dim() const {
  return static_cast<int64_t>(std::llround(static_cast<double>(head_dim) * partial_rotary_factor));
}

int64_t TextConfig::num_layers_of(LayerType type) const {
  int64_t count = 0;
  for (LayerType layer : layer_types) count += layer == type;
  return count;
}

void validate_model_config(const ModelConfig& config, const std::string& where) {
  validate_text(config.text, where, config.has_vision ? "text_config" : "");
  if (config.has_vision) {
    validate_vision(config.vision, config.text.hidden_size, where);
    for (const auto& [name, id] :
         {std::pair{"image_token_id", config.image_token_id}, std::pair{"video_token_id", config.video_token_id},
          std::pair{"vision_start_token_id", config.vision_start_token_id},
          std::pair{"vision_end_token_id", config.vision_end_token_id}}) {
      CHECK(id >= 0 && id < config.text.vocab_size, where, ": ", name, " (", id,
            ") is outside the vocabulary [0, text_config.vocab_size = ", config.text.vocab_size, ")");
    }
  }
}

ModelConfig parse_model_config(const std::string& json_text, const std::string& where) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& error) {  // parse_error, and out_of_range for a number that overflows
    RAISE(where, ": not valid JSON: ", error.what());
  }
  CHECK(root.is_object(), where, ": the top level must be a JSON object");
  JsonFieldReader top(root, where, "");
  CHECK(top.has("model_type"), where, ": model_type is missing; expected '", kVlmType, "' or '", kTextType, "'");
  ModelConfig config;
  config.model_type = top.get_string("model_type", "");
  config.original_json = json_text;
  if (config.model_type == kVlmType) {
    config.has_vision = true;
    const json* text = top.get_object("text_config");
    const json empty = json::object();
    config.text = parse_text_config(text ? *text : empty, where, "text_config");
    if (text) {
      std::string text_type = JsonFieldReader(*text, where, "text_config").get_string("model_type", kTextType);
      CHECK(text_type == kTextType, where, ": text_config.model_type is '", text_type, "'; expected '", kTextType, "'");
    }
    const json* vision = top.get_object("vision_config");
    config.vision = parse_vision_config(vision ? *vision : empty, where, "vision_config");
    config.image_token_id = top.get_int("image_token_id", config.image_token_id, 0);
    config.video_token_id = top.get_int("video_token_id", config.video_token_id, 0);
    config.vision_start_token_id = top.get_int("vision_start_token_id", config.vision_start_token_id, 0);
    config.vision_end_token_id = top.get_int("vision_end_token_id", config.vision_end_token_id, 0);
    config.tie_word_embeddings = top.get_bool("tie_word_embeddings", false);
  } else if (config.model_type == kTextType) {
    config.has_vision = false;
    config.text = parse_text_config(root, where, "");
    config.tie_word_embeddings = config.text.tie_word_embeddings;
  } else {
    RAISE(where, ": model_type '", config.model_type, "' is not supported; expected '", kVlmType,
          "' (vision-language) or '", kTextType, "' (text only)");
  }
  validate_model_config(config, where);
  return config;
}

ModelConfig load_model_config_file(const std::string& path) {
  std::filesystem::path file = path;
  if (std::filesystem::is_directory(file)) file /= "config.json";
  std::ifstream in(file, std::ios::binary);
  CHECK(in.good(), "cannot open ", file.string(), ": ", std::strerror(errno));
  std::stringstream text;
  text << in.rdbuf();
  return parse_model_config(text.str(), file.string());
}

ModelConfig resolve_model_config(const std::string& preset_or_path) {
  for (const std::string& name : model_config_preset_names()) {
    if (name == preset_or_path) return model_config_preset(name);
  }
  if (std::filesystem::exists(preset_or_path)) return load_model_config_file(preset_or_path);
  std::string names;
  for (const std::string& name : model_config_preset_names()) names += (names.empty() ? "" : ", ") + name;
  RAISE("'", preset_or_path, "' is neither a preset (", names, ") nor an existing config.json or model directory");
}

std::string model_config_to_json(const ModelConfig& config) {
  nlohmann::ordered_json out;
  if (config.has_vision) {
    out["architectures"] = {"Qwen3_5MoeForConditionalGeneration"};
    out["model_type"] = kVlmType;
    out["image_token_id"] = config.image_token_id;
    out["video_token_id"] = config.video_token_id;
    out["vision_start_token_id"] = config.vision_start_token_id;
    out["vision_end_token_id"] = config.vision_end_token_id;
    out["tie_word_embeddings"] = config.tie_word_embeddings;
    // transformers reads the load dtype ("auto") from the top level of a composite config.
    if (!config.text.dtype.empty()) out["dtype"] = config.text.dtype;
    out["text_config"] = text_config_json(config.text, kTextType);
    out["vision_config"] = vision_config_json(config.vision);
  } else {
    out = text_config_json(config.text, kTextType);
    out["architectures"] = {"Qwen3_5MoeForCausalLM"};
  }
  return out.dump(2) + "\n";
}

std::string preprocessor_config_json(const ModelConfig& config) {
  nlohmann::ordered_json out;
  out["image_processor_type"] = "Qwen2VLImageProcessorFast";
  out["processor_class"] = "Qwen3VLProcessor";
  out["size"] = {{"shortest_edge", 65536}, {"longest_edge", 16777216}};
  out["patch_size"] = config.vision.patch_size;
  out["temporal_patch_size"] = config.vision.temporal_patch_size;
  out["merge_size"] = config.vision.spatial_merge_size;
  out["image_mean"] = {0.5, 0.5, 0.5};
  out["image_std"] = {0.5, 0.5, 0.5};
  out["do_rescale"] = true;
  out["rescale_factor"] = 1.0 / 255.0;
  out["do_normalize"] = true;
  out["do_convert_rgb"] = true;
  return out.dump(2) + "\n";
}

}  // namespace deltamoe
