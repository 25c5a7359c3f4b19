// Tests of the parameter table: the 35B-A3B counts computed from the released checkpoint's tensor shapes, the
// active-per-token count by a separate hand formula, names/shapes/dtypes of the tiny models, and the expert
// naming helpers.
#include "model/param_table.h"

#include <gtest/gtest.h>

#include <set>

#include "model/config.h"

namespace deltamoe {
namespace {

int64_t component(const ParamCounts& counts, Component c) { return counts.by_component[static_cast<int>(c)]; }

TEST(ParamTable, Qwen35_35B_CountsMatchTheSpec) {
  ParamCounts counts = count_params(model_config_preset("qwen3.5-35b-a3b"));
  std::printf("35B-A3B: total %lld, active/token %lld\n", static_cast<long long>(counts.total),
              static_cast<long long>(counts.active_per_token));
  // Summed from the released Qwen3.5-35B-A3B checkpoint's tensor names and shapes.
  EXPECT_EQ(counts.total, 35'107'181'936);
  EXPECT_EQ(component(counts, Component::routed_experts), 32'212'254'720);
  EXPECT_EQ(component(counts, Component::gdn), 1'011'553'920);
  EXPECT_EQ(component(counts, Component::attention), 272'634'880);
  EXPECT_EQ(component(counts, Component::router_shared), 146'882'560);
  EXPECT_EQ(component(counts, Component::embedding), 1'017'118'720);
  EXPECT_EQ(component(counts, Component::norm), 165'888);
  EXPECT_EQ(component(counts, Component::vision), 446'571'248);
  EXPECT_EQ(counts.text_total, 34'660'610'688);
}

TEST(ParamTable, ActivePerTokenMatchesHandFormula) {
  for (const char* name : {"qwen3.5-35b-a3b", "qwen3.5-397b-a17b", "tiny"}) {
    ModelConfig config = model_config_preset(name);
    const TextConfig& t = config.text;
    const int64_t H = t.hidden_size, V = t.vocab_size, L = t.num_hidden_layers;
    const int64_t Lf = t.num_layers_of(LayerType::full_attention), Ll = L - Lf;
    const int64_t D = t.head_dim, Nq = t.num_attention_heads, Nkv = t.num_key_value_heads;
    const int64_t conv =
        2 * t.linear_num_key_heads * t.linear_key_head_dim + t.linear_num_value_heads * t.linear_value_head_dim;
    const int64_t vdim = t.linear_num_value_heads * t.linear_value_head_dim, Hv = t.linear_num_value_heads;
    const int64_t gdn = conv * H + vdim * H + 2 * Hv * H + conv * t.linear_conv_kernel_dim + 2 * Hv +
                        t.linear_value_head_dim + H * vdim;
    const int64_t attn = 2 * Nq * D * H + 2 * Nkv * D * H + H * Nq * D + 2 * D;
    const int64_t I = t.moe_intermediate_size, Is = t.shared_expert_intermediate_size;
    const int64_t moe_active = t.num_experts * H + t.num_experts_per_tok * 3 * I * H + 3 * Is * H + H;
    const int64_t expected = Ll * gdn + Lf * attn + L * (moe_active + 2 * H) + H + V * H /* lm_head */;
    ParamCounts counts = count_params(config);
    std::printf("%s: total %lld, active/token %lld (hand formula %lld)\n", name, static_cast<long long>(counts.total),
                static_cast<long long>(counts.active_per_token), static_cast<long long>(expected));
    EXPECT_EQ(counts.active_per_token, expected) << name;
    EXPECT_EQ(counts.active_per_token_with_embedding, expected + V * H) << name;
  }
}

TEST(ParamTable, VisionTensorCountIs9Plus12PerBlock) {
  ModelConfig config = model_config_preset("qwen3.5-35b-a3b");
  int vision = 0;
  for (const ParamSpec& spec : build_param_table(config)) vision += spec.component == Component::vision;
  EXPECT_EQ(vision, 9 + 12 * 27);
}

TEST(ParamTable, TinyNamesShapesAndDtypes) {
  ModelConfig config = model_config_preset("tiny");
  std::vector<ParamSpec> table = build_param_table(config, DType::bf16);
  std::set<std::string> names;
  for (const ParamSpec& spec : table) {
    EXPECT_TRUE(names.insert(spec.name).second) << "duplicate " << spec.name;
    EXPECT_EQ(spec.name.rfind("model.", 0) == 0 || spec.name == "lm_head.weight", true) << spec.name;
    EXPECT_EQ(spec.name.find("language_model"), std::string::npos) << spec.name;
  }
  auto find = [&](const std::string& name) -> const ParamSpec& {
    for (const ParamSpec& spec : table) {
      if (spec.name == name) return spec;
    }
    ADD_FAILURE() << "missing " << name;
    return table.front();
  };
  EXPECT_EQ(find("model.layers.0.linear_attn.in_proj_qkv.weight").shape, (Shape{128, 64}));
  EXPECT_EQ(find("model.layers.0.linear_attn.conv1d.weight").shape, (Shape{128, 1, 4}));
  EXPECT_EQ(find("model.layers.0.linear_attn.A_log").dtype, DType::f32);
  EXPECT_EQ(find("model.layers.0.linear_attn.dt_bias").dtype, DType::bf16);
  EXPECT_EQ(find("model.layers.0.linear_attn.norm.weight").init, InitKind::ones);
  EXPECT_EQ(find("model.layers.3.self_attn.q_proj.weight").shape, (Shape{2 * 4 * 32, 64}));
  EXPECT_EQ(find("model.layers.3.self_attn.q_norm.weight").init, InitKind::zeros);
  EXPECT_EQ(find("model.layers.3.mlp.experts.gate_up_proj").shape, (Shape{8, 64, 64}));
  EXPECT_EQ(find("model.layers.3.mlp.experts.down_proj").shape, (Shape{8, 64, 32}));
  EXPECT_EQ(find("model.layers.3.mlp.shared_expert_gate.weight").shape, (Shape{1, 64}));
  EXPECT_EQ(find("lm_head.weight").shape, (Shape{4096, 64}));
  EXPECT_EQ(fused_gate_up_name(config, 2), "model.layers.2.mlp.experts.gate_up_proj");
  EXPECT_EQ(per_expert_name(config, 2, 7, "up_proj"), "model.layers.2.mlp.experts.7.up_proj.weight");
  // GDN layers have no self_attn and vice versa.
  EXPECT_EQ(names.count("model.layers.0.self_attn.q_proj.weight"), 0u);
  EXPECT_EQ(names.count("model.layers.3.linear_attn.A_log"), 0u);
}

TEST(ParamTable, TinyVlHasVisionUnderModelVisual) {
  ModelConfig config = model_config_preset("tiny-vl");
  std::vector<ParamSpec> table = build_param_table(config, DType::f32);
  int vision = 0;
  for (const ParamSpec& spec : table) {
    if (spec.component == Component::vision) {
      ++vision;
      EXPECT_EQ(spec.name.rfind("model.visual.", 0), 0u) << spec.name;
    } else if (spec.name != "lm_head.weight") {
      EXPECT_EQ(spec.name.rfind("model.language_model.", 0), 0u) << spec.name;
    }
    EXPECT_EQ(spec.dtype, DType::f32) << spec.name;
  }
  EXPECT_EQ(vision, 9 + 12 * 2);
  EXPECT_EQ(table.back().name, "model.visual.merger.linear_fc2.bias");
}

TEST(ParamTable, TiedEmbeddingsDropLmHead) {
  ModelConfig config = model_config_preset("tiny");
  config.tie_word_embeddings = true;
  for (const ParamSpec& spec : build_param_table(config)) EXPECT_NE(spec.name, "lm_head.weight");
}

}  // namespace
}  // namespace deltamoe
