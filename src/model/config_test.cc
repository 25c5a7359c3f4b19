// Tests of config.json parsing: class defaults, both RoPE layouts, presets, the JSON round trip,
// and one rejection per rule, each asserting that the message names the offending field.
#include "model/config.h"

#include <gtest/gtest.h>

#include <string>

#include "core/error.h"

namespace deltamoe {
namespace {

// Runs parse_model_config and returns the error message ("" when it parsed).
std::string parse_error(const std::string& json_text) {
  try {
    parse_model_config(json_text, "test/config.json");
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

void expect_error_mentions(const std::string& json_text, const std::vector<std::string>& needles) {
  std::string message = parse_error(json_text);
  ASSERT_FALSE(message.empty()) << "expected a rejection of " << json_text;
  std::printf("rejected as expected: %s\n", message.c_str());
  for (const std::string& needle : needles) {
    EXPECT_NE(message.find(needle), std::string::npos) << "message lacks '" << needle << "': " << message;
  }
  EXPECT_NE(message.find("test/config.json"), std::string::npos) << message;
}

TEST(ModelConfig, TextOnlyDefaultsAreTheClassDefaults) {
  ModelConfig config = parse_model_config(R"({"model_type": "qwen3_5_moe_text"})", "x");
  const TextConfig& t = config.text;
  EXPECT_FALSE(config.has_vision);
  EXPECT_EQ(config.text_prefix(), "model");
  EXPECT_EQ(t.vocab_size, 248320);
  EXPECT_EQ(t.hidden_size, 2048);
  EXPECT_EQ(t.num_hidden_layers, 40);
  EXPECT_EQ(t.num_attention_heads, 16);
  EXPECT_EQ(t.num_key_value_heads, 2);
  EXPECT_EQ(t.head_dim, 256);
  EXPECT_EQ(t.linear_num_key_heads, 16);
  EXPECT_EQ(t.linear_num_value_heads, 32);
  EXPECT_EQ(t.num_experts, 256);
  EXPECT_EQ(t.num_experts_per_tok, 8);
  EXPECT_EQ(t.moe_intermediate_size, 512);
  EXPECT_EQ(t.shared_expert_intermediate_size, 512);
  EXPECT_DOUBLE_EQ(t.partial_rotary_factor, 0.25);
  EXPECT_EQ(t.rotary_dim(), 64);
  EXPECT_EQ(t.key_dim(), 16 * 128);
  EXPECT_EQ(t.value_dim(), 32 * 128);
  EXPECT_EQ(t.conv_dim(), 2 * 16 * 128 + 32 * 128);
  ASSERT_EQ(t.layer_types.size(), 40u);
  for (int i = 0; i < 40; ++i) {
    LayerType expected = (i + 1) % 4 == 0 ? LayerType::full_attention : LayerType::linear_attention;
    EXPECT_EQ(t.layer_types[i], expected) << "layer " << i;
  }
  EXPECT_EQ(t.num_layers_of(LayerType::full_attention), 10);
}

TEST(ModelConfig, FullAttentionIntervalDerivesLayerTypes) {
  ModelConfig config = parse_model_config(
      R"({"model_type": "qwen3_5_moe_text", "num_hidden_layers": 6, "full_attention_interval": 2})", "x");
  ASSERT_EQ(config.text.layer_types.size(), 6u);
  EXPECT_EQ(config.text.layer_types[0], LayerType::linear_attention);
  EXPECT_EQ(config.text.layer_types[1], LayerType::full_attention);
  EXPECT_EQ(config.text.num_layers_of(LayerType::full_attention), 3);
}

TEST(ModelConfig, OldAndNewRopeLayoutsAgree) {
  ModelConfig old_layout = parse_model_config(R"({"model_type": "qwen3_5_moe_text", "rope_theta": 5000000,
      "partial_rotary_factor": 0.5, "rope_scaling": {"type": "mrope", "mrope_section": [22, 21, 21],
      "mrope_interleaved": true}})",
                                              "old");
  ModelConfig new_layout = parse_model_config(R"({"model_type": "qwen3_5_moe_text", "rope_parameters":
      {"rope_type": "default", "rope_theta": 5000000, "partial_rotary_factor": 0.5,
       "mrope_section": [22, 21, 21], "mrope_interleaved": true}})",
                                              "new");
  for (const ModelConfig* config : {&old_layout, &new_layout}) {
    EXPECT_DOUBLE_EQ(config->text.rope_theta, 5e6);
    EXPECT_DOUBLE_EQ(config->text.partial_rotary_factor, 0.5);
    EXPECT_EQ(config->text.rotary_dim(), 128);
    EXPECT_EQ(config->text.mrope_section, (std::vector<int64_t>{22, 21, 21}));
  }
}

TEST(ModelConfig, VlmReadsNestedConfigsAndTokenIds) {
  ModelConfig config = parse_model_config(R"({"model_type": "qwen3_5_moe", "image_token_id": 7,
      "text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": 1024, "eos_token_id": [5, 6]},
      "vision_config": {"model_type": "qwen3_5_moe", "out_hidden_size": 1024, "depth": 3}})",
                                          "x");
  EXPECT_TRUE(config.has_vision);
  EXPECT_EQ(config.text_prefix(), "model.language_model");
  EXPECT_EQ(config.text.hidden_size, 1024);
  EXPECT_EQ(config.text.eos_token_id.value_or(-1), 5);
  EXPECT_EQ(config.vision.depth, 3);
  EXPECT_EQ(config.vision.hidden_size, 1152);
  EXPECT_EQ(config.vision.num_position_embeddings, 2304);
  EXPECT_EQ(config.image_token_id, 7);
  EXPECT_EQ(config.video_token_id, 248057);
  EXPECT_EQ(config.vision_start_token_id, 248053);
  EXPECT_EQ(config.vision_end_token_id, 248054);
}

TEST(ModelConfig, PresetsRoundTripThroughJson) {
  for (const std::string& name : model_config_preset_names()) {
    ModelConfig preset = model_config_preset(name);
    std::string json_text = model_config_to_json(preset);
    ModelConfig parsed = parse_model_config(json_text, name);
    EXPECT_EQ(model_config_to_json(parsed), json_text) << name;
    EXPECT_EQ(parsed.original_json, json_text);
    EXPECT_EQ(parsed.has_vision, preset.has_vision) << name;
  }
}

TEST(ModelConfig, TinyPresetsFollowTheIssue) {
  ModelConfig tiny = model_config_preset("tiny");
  EXPECT_FALSE(tiny.has_vision);
  EXPECT_EQ(tiny.text.hidden_size, 64);
  EXPECT_EQ(tiny.text.rotary_dim(), 8);
  EXPECT_EQ(tiny.text.conv_dim(), 2 * 2 * 16 + 4 * 16);
  // Specials keep the real ids' relative order and sit at the top of the 4096-id vocabulary.
  const int64_t real_first = 248044;
  int64_t shift = *tiny.text.eos_token_id - real_first;
  EXPECT_EQ(tiny.image_token_id, 248056 + shift);
  EXPECT_EQ(tiny.video_token_id, 248057 + shift);
  EXPECT_EQ(tiny.vision_start_token_id, 248053 + shift);
  EXPECT_EQ(tiny.vision_end_token_id, 248054 + shift);
  EXPECT_EQ(248076 + shift, tiny.text.vocab_size - 1) << "last special (248076) must be the last id";
  ModelConfig vl = model_config_preset("tiny-vl");
  EXPECT_TRUE(vl.has_vision);
  EXPECT_EQ(vl.vision.out_hidden_size, vl.text.hidden_size);
  EXPECT_EQ(vl.vision.num_position_embeddings, 64);
}

TEST(ModelConfig, RejectsUnknownModelType) {
  expect_error_mentions(R"({"model_type": "qwen3_moe"})", {"model_type", "qwen3_moe"});
  expect_error_mentions(R"({"hidden_size": 3})", {"model_type"});
}

TEST(ModelConfig, RejectsBadJson) { expect_error_mentions(R"({"model_type": )", {"not valid JSON"}); }

TEST(ModelConfig, RejectsHeadsThatDoNotDivide) {
  expect_error_mentions(R"({"model_type": "qwen3_5_moe_text", "num_attention_heads": 6, "num_key_value_heads": 4})",
                        {"num_attention_heads", "num_key_value_heads"});
  expect_error_mentions(R"({"model_type": "qwen3_5_moe_text", "linear_num_value_heads": 24})",
                        {"linear_num_value_heads"});
}

TEST(ModelConfig, RejectsMropeSectionNotSummingToHalfRotaryDim) {
  expect_error_mentions(R"({"model_type": "qwen3_5_moe_text", "rope_parameters": {"mrope_section": [11, 11, 11]}})",
                        {"mrope_section", "33", "32"});
  // head_dim 32 x 0.25 = 8 rotary channels: the default [11, 11, 10] no longer fits.
  expect_error_mentions(R"({"model_type": "qwen3_5_moe_text", "head_dim": 32})", {"mrope_section"});
}

TEST(ModelConfig, RejectsOddRotaryDim) {
  expect_error_mentions(R"({"model_type": "qwen3_5_moe_text", "partial_rotary_factor": 0.3})",
                        {"partial_rotary_factor"});
}

TEST(ModelConfig, RejectsLayerTypeProblems) {
  expect_error_mentions(R"({"model_type": "qwen3_5_moe_text", "num_hidden_layers": 2,
      "layer_types": ["linear_attention"]})",
                        {"layer_types", "num_hidden_layers"});
  expect_error_mentions(R"({"model_type": "qwen3_5_moe_text", "num_hidden_layers": 1,
      "layer_types": ["mamba"]})",
                        {"layer_types[0]", "mamba"});
}

TEST(ModelConfig, RejectsWrongJsonTypesNamingTheField) {
  expect_error_mentions(R"({"model_type": "qwen3_5_moe_text", "hidden_size": "big"})", {"hidden_size", "integer"});
  expect_error_mentions(R"({"model_type": "qwen3_5_moe", "text_config": {"num_experts": 0},
      "vision_config": {"out_hidden_size": 2048}})",
                        {"text_config.num_experts"});
  expect_error_mentions(R"({"model_type": "qwen3_5_moe_text", "num_experts": 4, "num_experts_per_tok": 8})",
                        {"num_experts_per_tok"});
}

TEST(ModelConfig, RejectsInconsistentVision) {
  // transformers' class defaults pair a 3584-wide merger with a 2048-wide text model.
  expect_error_mentions(R"({"model_type": "qwen3_5_moe"})", {"vision_config.out_hidden_size", "3584", "2048"});
  expect_error_mentions(R"({"model_type": "qwen3_5_moe", "vision_config": {"out_hidden_size": 2048,
      "num_position_embeddings": 2000}})",
                        {"vision_config.num_position_embeddings"});
  expect_error_mentions(R"({"model_type": "qwen3_5_moe", "vision_config": {"out_hidden_size": 2048,
      "num_heads": 5}})",
                        {"vision_config.num_heads"});
  expect_error_mentions(R"({"model_type": "qwen3_5_moe", "image_token_id": 300000,
      "vision_config": {"out_hidden_size": 2048}})",
                        {"image_token_id"});
}

TEST(ModelConfig, RejectsScaledRope) {
  expect_error_mentions(R"({"model_type": "qwen3_5_moe_text", "rope_parameters": {"rope_type": "yarn"}})",
                        {"rope_parameters.rope_type", "yarn"});
}

}  // namespace
}  // namespace deltamoe
