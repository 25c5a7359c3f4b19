// LoRA on the CPU reference: PEFT's target resolution on the tiny VLM, the expert delta against
// PEFT's reshapes written out literally, B = 0 leaves the model unchanged, and the adapters'
// gradients (text model in fp32 against directional finite differences with the routing pinned;
// vision tower in fp64 against central differences) while the base weights get none; with LoRA
// dropout: refused with the experts as PEFT does, the same gradient checks inside a training pass's
// masks, p = 0 bitwise the plain path, no dropping outside a training pass, and the unmerged shared
// expert (taken when an adapter of it drops) equal to the merged one.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "core/error.h"
#include "core/rng.h"
#include "kernels/cross_entropy/cross_entropy.h"
#include "kernels/gradcheck/gradcheck.h"
#include "model/lora/lora_adapters.h"
#include "model/lora/lora_dropout.h"
#include "model/text/text_model.h"
#include "model/vision/vision_tower.h"

namespace deltamoe {
namespace {

LoraOptions all_options(int64_t rank = 2) {
  LoraOptions options;
  options.rank = rank;
  options.alpha = 3;
  options.target_modules = {"all-linear"};
  options.target_parameters = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  return options;
}

TEST(Lora, AllLinearResolvesToPeftsModulesOnTheVlm) {
  const ModelConfig config = model_config_preset("tiny-vl");
  const std::vector<LoraTarget> targets = resolve_lora_targets(config, all_options());
  std::set<std::string> names;
  int64_t linears = 0, experts = 0;
  for (const LoraTarget& t : targets) {
    names.insert(t.module);
    (t.experts ? experts : linears) += 1;
  }
  int64_t gdn = 0, full = 0;
  for (LayerType type : config.text.layer_types) (type == LayerType::linear_attention ? gdn : full) += 1;
  const int64_t layers = config.text.num_hidden_layers;
  // GDN: in_proj_qkv/z/b/a + out_proj; attention q/k/v/o; every layer: shared_expert gate/up/down and
  // shared_expert_gate; vision: 4 per block, 2 in the merger.
  EXPECT_EQ(linears, 5 * gdn + 4 * full + 4 * layers + 4 * config.vision.depth + 2);
  EXPECT_EQ(experts, 2 * layers);
  for (const std::string& name : names) {
    EXPECT_EQ(name.find("lm_head"), std::string::npos);
    EXPECT_FALSE(name.ends_with(".mlp.gate")) << "the router is not an nn.Linear in transformers";
    EXPECT_EQ(name.find("conv1d"), std::string::npos);
    EXPECT_EQ(name.find("patch_embed"), std::string::npos);
    EXPECT_EQ(name.find("embed_tokens"), std::string::npos);
  }
  EXPECT_TRUE(names.count("model.visual.merger.linear_fc1"));
  EXPECT_TRUE(names.count("model.visual.blocks.0.attn.qkv"));
  EXPECT_TRUE(names.count("model.language_model.layers.0.mlp.shared_expert_gate"));
  EXPECT_TRUE(names.count("model.language_model.layers.0.mlp.experts.gate_up_proj"));
}

TEST(Lora, NamedTargetsMatchBySuffixAndRefuseNonLinearModules) {
  const ModelConfig config = model_config_preset("tiny-vl");
  LoraOptions options;
  options.target_modules = {"q_proj", "linear_fc2"};
  int64_t full = 0;
  for (LayerType type : config.text.layer_types) full += type == LayerType::full_attention;
  EXPECT_EQ(static_cast<int64_t>(resolve_lora_targets(config, options).size()), full + config.vision.depth + 1);
  for (const char* bad : {"gate", "conv1d", "patch_embed.proj", "embed_tokens"}) {
    options.target_modules = {bad};
    EXPECT_THROW(resolve_lora_targets(config, options), Error) << bad;
  }
  options.target_modules = {"no_such_proj"};
  EXPECT_THROW(resolve_lora_targets(config, options), Error);
  options.target_modules = {"all-linear", "q_proj"};
  EXPECT_THROW(resolve_lora_targets(config, options), Error);
  options = all_options();
  options.dropout = 0.05;
  EXPECT_THROW(options.validate(), Error);
}

TEST(Lora, PeftKeysNestTheExpertWrappersInRegistrationOrder) {
  const ModelConfig config = model_config_preset("tiny-vl");
  const std::vector<LoraTarget> both = resolve_lora_targets(config, all_options());
  std::set<std::string> keys;
  for (const LoraTarget& t : both) keys.insert(peft_adapter_key(t, both, "lora_A"));
  EXPECT_TRUE(keys.count("base_model.model.model.language_model.layers.0.mlp.experts.base_layer.lora_A.weight"));
  EXPECT_TRUE(keys.count("base_model.model.model.language_model.layers.0.mlp.experts.lora_A.weight"));
  EXPECT_TRUE(keys.count("base_model.model.model.visual.blocks.1.mlp.linear_fc2.lora_A.weight"));
  EXPECT_EQ(keys.size(), both.size());
  LoraOptions only_down;
  only_down.target_modules = {};
  only_down.target_parameters = {"mlp.experts.gate_up_proj"};
  const std::vector<LoraTarget> one = resolve_lora_targets(config, only_down);
  EXPECT_EQ(peft_adapter_key(one[0], one, "lora_B"), "base_model.model." + one[0].module.substr(0, one[0].module.rfind('.')) +
                                                         ".lora_B.weight");
}

// PEFT 0.21 on a fused [E, out, in] weight: A.reshape(E, r, in), B.reshape(out, r, E),
// delta = einsum("o r e, e r i -> e o i") * s (the orientation its merge_and_unload showed on the
// golden files: lora_golden_test).
TEST(Lora, ExpertDeltaIsPeftsEinsum) {
  LoraTarget t;
  t.module = "x.mlp.experts.gate_up_proj";
  t.experts = true;
  t.num_experts = 3, t.out_features = 5, t.in_features = 4;
  const int64_t r = 2, E = 3, IN = 4, OUT = 5;
  Rng rng(3);
  std::vector<double> a(r * E * IN), b(OUT * r * E), delta(E * OUT * IN);
  for (double& v : a) v = rng.normal();
  for (double& v : b) v = rng.normal();
  lora_delta(t, r, a.data(), b.data(), 1.5, delta.data());
  double worst = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < OUT; ++o)
      for (int64_t i = 0; i < IN; ++i) {
        double sum = 0;
        for (int64_t k = 0; k < r; ++k) {
          const double a_eri = a[((e * r) + k) * IN + i];  // A viewed [E, r, in]
          const double b_ore = b[(o * r + k) * E + e];     // B viewed [out, r, E]
          sum += b_ore * a_eri;
        }
        worst = std::max(worst, std::abs(delta[(e * OUT + o) * IN + i] - 1.5 * sum));
      }
  EXPECT_LT(worst, 1e-12);
  // The backward is the transpose of the delta: <delta(A, B) linear parts> checked by finite differences.
  std::vector<double> d_weight(E * OUT * IN), d_a(a.size(), 0.0), d_b(b.size(), 0.0);
  for (double& v : d_weight) v = rng.normal();
  lora_delta_backward(t, r, a.data(), b.data(), 1.5, d_weight.data(), d_a.data(), d_b.data());
  auto loss = [&] {
    std::vector<double> out(E * OUT * IN);
    lora_delta(t, r, a.data(), b.data(), 1.5, out.data());
    return gradcheck::dot(out, d_weight);
  };
  EXPECT_LT(gradcheck::check_gradient("A", a, d_a, loss).relative(), gradcheck::kGradTolerance);
  EXPECT_LT(gradcheck::check_gradient("B", b, d_b, loss).relative(), gradcheck::kGradTolerance);
}

TextConfig tiny_text() {
  TextConfig c;
  c.vocab_size = 256;
  c.hidden_size = 32;
  c.num_hidden_layers = 2;
  c.layer_types = {LayerType::linear_attention, LayerType::full_attention};
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 16;
  c.rope_theta = 1e7;
  c.partial_rotary_factor = 0.25;
  c.mrope_section = {1, 1, 0};
  c.linear_conv_kernel_dim = 4;
  c.linear_num_key_heads = 2;
  c.linear_num_value_heads = 2;
  c.linear_key_head_dim = 8;
  c.linear_value_head_dim = 8;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 16;
  c.shared_expert_intermediate_size = 16;
  c.rms_norm_eps = 1e-6;
  return c;
}

ModelConfig text_model_config() {
  ModelConfig config;
  config.model_type = "qwen3_5_moe_text";
  config.has_vision = false;
  config.text = tiny_text();
  return config;
}

// Adapters on every linear (lm_head too) and on both expert weights, with B random (not PEFT's
// zero) so that every gradient is exercised.
LoraAdapters random_adapters(const ModelConfig& config, bool random_b) {
  LoraOptions options = all_options();
  options.target_modules = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj",
                            "v_proj", "o_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
                            "shared_expert.down_proj", "shared_expert_gate", "lm_head", "attn.qkv", "attn.proj",
                            "linear_fc1", "linear_fc2"};
  if (!config.has_vision) options.target_modules.resize(14);
  LoraAdapters adapters = init_lora_adapters(config, options, 11);
  Rng rng(12);
  for (const LoraTarget& t : adapters.targets) {
    HostTensor& b = adapters.tensors.at(t.b_name());
    for (int64_t i = 0; i < b.numel(); ++i) b.as<float>()[i] = random_b ? static_cast<float>(0.3 * rng.normal()) : 0.0f;
  }
  return adapters;
}

TEST(Lora, ZeroBLeavesTheTextModelUnchanged) {
  const ModelConfig config = text_model_config();
  const ParamMap base = random_text_params(config.text, "model", 5);
  ParamMap adapted = base;
  attach_lora_adapters(random_adapters(config, false), &adapted, nullptr);
  Rng rng(6);
  const int64_t T = 12;
  std::vector<int64_t> ids(T);
  for (auto& id : ids) id = static_cast<int64_t>(rng.below(config.text.vocab_size));
  const TextBatch batch = make_text_batch(config.text, T, {0, static_cast<int32_t>(T)});
  TextModel a(config.text, "model", &base), b(config.text, "model", &adapted);
  const std::vector<float> la = a.forward(batch, {ids.data()}).logits, lb = b.forward(batch, {ids.data()}).logits;
  double worst = 0;
  for (size_t i = 0; i < la.size(); ++i) worst = std::max(worst, std::abs(double(la[i]) - lb[i]));
  EXPECT_LT(worst, 1e-5);  // A x is added as exact zeros times B; only the merged expert sums may round
}

// Worst relative error of the directional derivative of ce + 0.5 aux along each adapter tensor's
// gradient (fp32 model, routing pinned to the first forward's), over every trained tensor of
// adapters attached to params. Runs inside whatever LoRA dropout scope the caller opened.
double worst_text_adapter_fd_error(const ModelConfig& config, ParamMap& params, const LoraAdapters& adapters) {
  Rng rng(8);
  const int64_t T = 16;
  std::vector<int64_t> ids(T), labels(T), shifted(T);
  for (auto& id : ids) id = static_cast<int64_t>(rng.below(config.text.vocab_size));
  for (auto& id : labels) id = static_cast<int64_t>(rng.below(config.text.vocab_size));
  shift_labels_ref(labels.data(), shifted.data(), 1, T);
  const TextBatch batch = make_text_batch(config.text, T, {0, 7, static_cast<int32_t>(T)});
  TextModel model(config.text, "model", &params);
  model.forward(batch, {ids.data(), nullptr, shifted.data()});
  std::vector<std::vector<int32_t>> routing;
  for (const DecoderLayerSaved& layer : model.saved_layers()) routing.push_back(layer.moe.topk_idx);
  ParamMap grads;
  for (const std::string& name : adapters.trained_names()) grads[name] = {params.at(name).shape, std::vector<float>(params.at(name).values.size(), 0.0f)};
  weight_grad_counts() = {};
  model.backward_into(&grads, 1.0f, 0.5f);
  EXPECT_GT(weight_grad_counts().skipped, 0) << "the base weights' products must be skipped";
  double worst = 0;
  std::string worst_name;
  for (const std::string& name : adapters.trained_names()) {
    std::vector<float>& values = params.at(name).values;
    const std::vector<float>& grad = grads.at(name).values;
    double norm = 0;
    for (float g : grad) norm += double(g) * g;
    EXPECT_GT(norm, 0) << name << " got no gradient";
    if (norm == 0) return 1.0;
    norm = std::sqrt(norm);
    auto loss_at = [&](double offset) {
      const std::vector<float> saved = values;
      for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(saved[i] + offset * grad[i] / norm);
      TextModel probe(config.text, "model", &params);
      const TextModelOutput out = probe.forward(batch, {ids.data(), nullptr, shifted.data(), &routing});
      values = saved;
      return out.ce_loss + 0.5 * out.aux_loss;
    };
    const double analytic = norm;  // derivative along grad / |grad|
    const double h = std::min(1e-2, 1e-3 / analytic);
    auto central = [&](double step) { return (loss_at(step) - loss_at(-step)) / (2 * step); };
    const double numeric = (4 * central(h / 2) - central(h)) / 3;
    const double error = std::abs(numeric - analytic) / std::max(std::abs(numeric), 1e-3);
    if (error > worst) worst = error, worst_name = name;
  }
  std::printf("  %zu adapter tensors, worst directional-derivative rel error %.3e (%s)\n",
              adapters.trained_names().size(), worst, worst_name.c_str());
  return worst;
}

TEST(Lora, TextAdapterGradientsMatchDirectionalFiniteDifferences) {
  const ModelConfig config = text_model_config();
  ParamMap params = random_text_params(config.text, "model", 7);
  const LoraAdapters adapters = random_adapters(config, true);
  attach_lora_adapters(adapters, &params, nullptr);
  EXPECT_LT(worst_text_adapter_fd_error(config, params, adapters), 1e-2);
}

// Adapters on every text Linear (lm_head and the shared expert included) with LoRA dropout p; no
// expert adapters (PEFT refuses dropout there).
LoraAdapters dropout_adapters(const ModelConfig& config, double p) {
  LoraAdapters adapters = random_adapters(config, true);
  LoraOptions options = adapters.options;
  options.target_parameters.clear();
  options.dropout = p;
  LoraAdapters with_dropout = init_lora_adapters(config, options, 11);
  for (auto& [name, tensor] : with_dropout.tensors) tensor = adapters.tensors.at(name);
  return with_dropout;
}

TEST(Lora, DropoutWithTargetParametersIsRefusedAsPeftDoes) {
  LoraOptions options = all_options();
  options.dropout = 0.05;
  try {
    options.validate();
    ADD_FAILURE() << "--lora_dropout with --target_parameters must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ParamWrapper"), std::string::npos) << e.what();
  }
  options.target_parameters.clear();
  EXPECT_NO_THROW(options.validate());
  options.dropout = 1.0;
  EXPECT_THROW(options.validate(), Error);
}

TEST(Lora, TextDropoutGradientsMatchDirectionalFiniteDifferences) {
  const ModelConfig config = text_model_config();
  ParamMap params = random_text_params(config.text, "model", 7);
  const LoraAdapters adapters = dropout_adapters(config, 0.3);
  attach_lora_adapters(adapters, &params, nullptr);
  // Every forward of the check (the probes too) sees this pass's masks.
  const LoraDropoutScope scope(0.3, 11, 5, 2);
  EXPECT_LT(worst_text_adapter_fd_error(config, params, adapters), 1e-2);
}

// Logits, ce and every adapter gradient of one forward + backward.
struct TextPass {
  std::vector<float> logits;
  ParamMap grads;
};

TextPass text_pass(const ModelConfig& config, const ParamMap& params, const LoraAdapters& adapters) {
  Rng rng(21);
  const int64_t T = 16;
  std::vector<int64_t> ids(T), labels(T), shifted(T);
  for (auto& id : ids) id = static_cast<int64_t>(rng.below(config.text.vocab_size));
  for (auto& id : labels) id = static_cast<int64_t>(rng.below(config.text.vocab_size));
  shift_labels_ref(labels.data(), shifted.data(), 1, T);
  const TextBatch batch = make_text_batch(config.text, T, {0, 9, static_cast<int32_t>(T)});
  TextModel model(config.text, "model", &params);
  TextPass pass;
  pass.logits = model.forward(batch, {ids.data(), nullptr, shifted.data()}).logits;
  for (const std::string& name : adapters.trained_names()) {
    pass.grads[name] = {params.at(name).shape, std::vector<float>(params.at(name).values.size(), 0.0f)};
  }
  model.backward_into(&pass.grads, 1.0f, 0.5f);
  return pass;
}

bool bitwise_equal(const TextPass& a, const TextPass& b) {
  if (a.logits != b.logits || a.grads.size() != b.grads.size()) return false;
  for (const auto& [name, grad] : a.grads) {
    if (grad.values != b.grads.at(name).values) return false;
  }
  return true;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(double(a[i]) - b[i]));
  return worst;
}

TEST(Lora, DropoutZeroIsThePlainPathAndEvaluationNeverDrops) {
  const ModelConfig config = text_model_config();
  const ParamMap base = random_text_params(config.text, "model", 7);
  const LoraAdapters zero = dropout_adapters(config, 0.0), some = dropout_adapters(config, 0.3);
  ParamMap plain = base, with_p = base;
  attach_lora_adapters(zero, &plain, nullptr);
  attach_lora_adapters(some, &with_p, nullptr);
  for (const auto& [name, tensor] : plain) EXPECT_FALSE(name.ends_with(".lora_index")) << "p = 0 adds " << name;
  EXPECT_EQ(with_p.size(), plain.size() + some.targets.size()) << "p > 0: one index entry per adapter";
  const TextPass reference = text_pass(config, plain, zero);
  {
    const LoraDropoutScope scope(0.0, 11, 5, 2);
    EXPECT_TRUE(bitwise_equal(text_pass(config, plain, zero), reference)) << "p = 0 in a training pass";
  }
  // Outside a training pass (evaluation, export, parity) adapters with p > 0 drop nothing.
  EXPECT_TRUE(bitwise_equal(text_pass(config, with_p, some), reference)) << "p > 0 outside a training pass";
  // In one they drop, and the same counters give the same pass.
  const LoraDropoutScope scope(0.3, 11, 5, 2);
  const TextPass dropped = text_pass(config, with_p, some);
  EXPECT_GT(max_abs_diff(dropped.logits, reference.logits), 1e-3);
  EXPECT_TRUE(bitwise_equal(text_pass(config, with_p, some), dropped));
}

// p = 1e-9 makes the mask active (the shared expert runs unmerged through the funnel) while dropping
// nothing with keep_scale 1.0f exactly: the unmerged shared expert must equal the merged one.
TEST(Lora, UnmergedSharedExpertEqualsTheMergedOne) {
  const ModelConfig config = text_model_config();
  const ParamMap base = random_text_params(config.text, "model", 7);
  const LoraAdapters tiny = dropout_adapters(config, 1e-9);
  ParamMap params = base;
  attach_lora_adapters(tiny, &params, nullptr);
  const TextPass merged = text_pass(config, params, tiny);
  const LoraDropoutScope scope(1e-9, 11, 5, 2);
  ASSERT_TRUE(lora_dropout_for(0).active());
  ASSERT_EQ(lora_dropout_for(0).keep_scale, 1.0f);
  const TextPass unmerged = text_pass(config, params, tiny);
  EXPECT_FALSE(bitwise_equal(unmerged, merged)) << "the shared expert did not take the unmerged path";
  EXPECT_LT(max_abs_diff(unmerged.logits, merged.logits), 1e-4);
  for (const auto& [name, grad] : merged.grads) {
    double scale = 0;
    for (float g : grad.values) scale = std::max(scale, double(std::abs(g)));
    EXPECT_LT(max_abs_diff(unmerged.grads.at(name).values, grad.values), 1e-4 * std::max(scale, 1.0)) << name;
  }
}

// The vision tower's adapters against central differences in fp64, with LoRA dropout p on every
// adapter when p > 0 (in a training pass's scope).
void check_vision_adapter_gradients(double p) {
  VisionConfig config;
  config.depth = 1;
  config.hidden_size = 8;
  config.num_heads = 2;
  config.intermediate_size = 12;
  config.patch_size = 2;
  config.temporal_patch_size = 2;
  config.spatial_merge_size = 2;
  config.out_hidden_size = 5;
  config.num_position_embeddings = 16;
  Rng rng(9);
  VisionParams params;
  for (const auto& [name, shape] : vision_param_shapes(config)) {
    HostTensor tensor(DType::f64, shape);
    const bool norm = name.find("norm") != std::string::npos && name.ends_with(".weight");
    for (int64_t i = 0; i < tensor.numel(); ++i) tensor.as<double>()[i] = (norm ? 1.0 : 0.0) + 0.4 * rng.normal();
    params.emplace(name, tensor);
  }
  std::vector<std::string> trained;
  for (const char* module : {"blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.linear_fc1",
                             "blocks.0.mlp.linear_fc2", "merger.linear_fc1", "merger.linear_fc2"}) {
    const std::string m = std::string("model.visual.") + module;
    const Shape w = params.at(m + ".weight").shape();
    const int64_t r = 2;
    for (const auto& [suffix, shape] : {std::pair<std::string, Shape>{".lora_A.weight", Shape{r, w[1]}},
                                        std::pair<std::string, Shape>{".lora_B.weight", Shape{w[0], r}}}) {
      HostTensor tensor(DType::f64, shape);
      for (int64_t i = 0; i < tensor.numel(); ++i) tensor.as<double>()[i] = 0.5 * rng.normal();
      params.emplace(m + suffix, tensor);
      trained.push_back(m + suffix);
    }
    HostTensor scale(DType::f64, Shape{1});
    *scale.as<double>() = 1.25;
    params.emplace(m + ".lora_scaling", scale);
    if (p > 0) {
      HostTensor index(DType::f64, Shape{1});
      *index.as<double>() = static_cast<double>(trained.size() / 2 - 1);
      params.emplace(m + ".lora_index", index);
    }
  }
  HostTensor grid(DType::i64, Shape{1, 3});
  grid.as<int64_t>()[0] = 1, grid.as<int64_t>()[1] = 2, grid.as<int64_t>()[2] = 4;
  HostTensor pixels(DType::f64, Shape{8, config.patch_dim()}), d_features(DType::f64, Shape{2, config.out_hidden_size});
  for (int64_t i = 0; i < pixels.numel(); ++i) pixels.as<double>()[i] = rng.normal();
  for (int64_t i = 0; i < d_features.numel(); ++i) d_features.as<double>()[i] = rng.normal();
  auto to_vector = [](const HostTensor& t) { return std::vector<double>(t.as<double>(), t.as<double>() + t.numel()); };
  const std::vector<double> plain = to_vector(vision_tower_forward(params, config, pixels, grid).features);
  // Every forward of the check sees this training pass's masks, which do change the features.
  const LoraDropoutScope scope(p, 13, 2, 0);
  const std::vector<double> in_pass = to_vector(vision_tower_forward(params, config, pixels, grid).features);
  double change = 0;
  for (size_t i = 0; i < plain.size(); ++i) change = std::max(change, std::abs(plain[i] - in_pass[i]));
  if (p > 0) {
    EXPECT_GT(change, 1e-3) << "dropout left the features unchanged";
  } else {
    EXPECT_EQ(change, 0.0);
  }
  auto loss = [&] {
    return gradcheck::dot(to_vector(vision_tower_forward(params, config, pixels, grid).features), to_vector(d_features));
  };
  const VisionTowerOutput output = vision_tower_forward(params, config, pixels, grid);
  VisionParams grads;
  for (const std::string& name : trained) {
    HostTensor zero(DType::f64, params.at(name).shape());
    std::fill_n(zero.as<double>(), zero.numel(), 0.0);
    grads.emplace(name, zero);
  }
  TrainableParts parts;
  parts.base_weights = false;
  vision_tower_backward(params, config, output.saved, d_features, &grads, "model.visual", parts);
  EXPECT_EQ(grads.size(), trained.size()) << "no base weight may get a gradient under LoRA";
  double worst = 0;
  for (const std::string& name : trained) {
    std::vector<double> values = to_vector(params.at(name));
    auto tensor_loss = [&] {
      std::copy(values.begin(), values.end(), params.at(name).as<double>());
      return loss();
    };
    const double error = gradcheck::check_gradient(name, values, to_vector(grads.at(name)), tensor_loss).relative();
    std::copy(values.begin(), values.end(), params.at(name).as<double>());
    worst = std::max(worst, error);
    EXPECT_LT(error, gradcheck::kGradTolerance) << name;
  }
  std::printf("  worst vision adapter gradient relative error %.3e (dropout %.2f)\n", worst, p);
}

TEST(Lora, VisionAdapterGradientsMatchFiniteDifferencesInFloat64) { check_vision_adapter_gradients(0.0); }

TEST(Lora, VisionDropoutGradientsMatchFiniteDifferencesInFloat64) {
  check_vision_adapter_gradients(0.4);
}

}  // namespace
}  // namespace deltamoe
