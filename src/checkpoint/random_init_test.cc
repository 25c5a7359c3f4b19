// Tests of random initialisation: determinism by (seed, name), transformers' init per kind
// (normal std, zero-centred norms 0, gated norm / dt_bias / LayerNorm 1, biases 0, A_log range).
#include "checkpoint/random_init.h"

#include <gtest/gtest.h>

#include <cmath>

namespace deltamoe {
namespace {

struct Stats {
  double mean = 0, std_dev = 0, min = 1e30, max = -1e30;
};
Stats stats_of(const StoredTensor& tensor) {
  HostTensor values = tensor.to_host().dtype() == DType::f32 ? tensor.to_host() : tensor.to_host().to_f32();
  Stats s;
  const int64_t n = values.numel();
  double sum = 0, sum_sq = 0;
  for (int64_t i = 0; i < n; ++i) {
    double v = values.as<float>()[i];
    sum += v;
    sum_sq += v * v;
    s.min = std::min(s.min, v);
    s.max = std::max(s.max, v);
  }
  s.mean = sum / n;
  s.std_dev = std::sqrt(std::max(0.0, sum_sq / n - s.mean * s.mean));
  return s;
}

TEST(RandomInit, SameSeedSameBytesOtherSeedOtherBytes) {
  ModelConfig config = model_config_preset("tiny");
  ModelCheckpoint a = random_init_checkpoint(config, 7, DType::bf16);
  ModelCheckpoint b = random_init_checkpoint(config, 7, DType::bf16);
  ModelCheckpoint c = random_init_checkpoint(config, 8, DType::bf16);
  int differing_same_seed = 0, equal_other_seed = 0;
  for (const auto& [name, tensor] : a.params) {
    differing_same_seed += !tensor.bitwise_equal(b.params.at(name));
    if (name.find("layernorm") == std::string::npos && name.find("norm.weight") == std::string::npos &&
        name.find("dt_bias") == std::string::npos) {
      equal_other_seed += tensor.bitwise_equal(c.params.at(name));
    }
  }
  std::printf("same seed: %d differing tensors; other seed: %d identical random tensors\n", differing_same_seed,
              equal_other_seed);
  EXPECT_EQ(differing_same_seed, 0);
  EXPECT_EQ(equal_other_seed, 0);
}

TEST(RandomInit, ValuesDependOnNameNotOnOtherTensors) {
  ModelConfig small = model_config_preset("tiny");
  ModelConfig bigger = small;
  bigger.text.num_hidden_layers = 8;
  bigger.text.layer_types.insert(bigger.text.layer_types.end(), small.text.layer_types.begin(),
                                 small.text.layer_types.end());
  ModelCheckpoint a = random_init_checkpoint(small, 3, DType::f32);
  ModelCheckpoint b = random_init_checkpoint(bigger, 3, DType::f32);
  const std::string name = "model.layers.1.linear_attn.in_proj_qkv.weight";
  EXPECT_TRUE(a.params.at(name).bitwise_equal(b.params.at(name)));
}

TEST(RandomInit, NormalTensorsHaveInitializerRangeStd) {
  ModelConfig config = model_config_preset("tiny");
  config.text.vocab_size = 40000;  // 2.56 M values, produced by several threads
  config.text.bos_token_id = config.text.eos_token_id = std::nullopt;
  ModelCheckpoint checkpoint = random_init_checkpoint(config, 11, DType::f32);
  Stats s = stats_of(checkpoint.params.at("model.embed_tokens.weight"));
  std::printf("embed_tokens: mean %.6f std %.6f (expected 0, 0.02), min %.4f max %.4f\n", s.mean, s.std_dev, s.min,
              s.max);
  EXPECT_NEAR(s.mean, 0.0, 1e-4);
  EXPECT_NEAR(s.std_dev, 0.02, 0.02 * 0.01);
  // Values far apart must not repeat each other (different counters).
  HostTensor values = checkpoint.params.at("model.embed_tokens.weight").to_host();
  const int64_t block = int64_t{1} << 20;
  int64_t equal = 0;
  for (int64_t i = 0; i < 1000; ++i) equal += values.as<float>()[i] == values.as<float>()[block + i];
  EXPECT_LT(equal, 5);
  Stats experts = stats_of(checkpoint.params.at("model.layers.0.mlp.experts.gate_up_proj"));
  std::printf("experts.gate_up_proj: mean %.6f std %.6f\n", experts.mean, experts.std_dev);
  EXPECT_NEAR(experts.std_dev, 0.02, 0.02 * 0.05);
}

// Streamed writes and per-expert saves ask for arbitrary ranges; every way of reading must give
// the same bytes.
TEST(RandomInit, PiecesAndSlicesMatchTheWholeTensor) {
  ModelConfig config = model_config_preset("tiny");
  config.text.vocab_size = 40000;  // embed_tokens: 2.56 M values
  config.text.bos_token_id = config.text.eos_token_id = std::nullopt;
  ModelCheckpoint checkpoint = random_init_checkpoint(config, 21, DType::bf16);
  const StoredTensor& embed = checkpoint.params.at("model.embed_tokens.weight");
  HostTensor whole = embed.to_host();
  const uint8_t* bytes = static_cast<const uint8_t*>(whole.data());
  std::vector<uint8_t> streamed;
  embed.for_each_piece([&](const uint8_t* data, size_t n) { streamed.insert(streamed.end(), data, data + n); },
                       1'234'567);  // not a multiple of the element size
  ASSERT_EQ(streamed.size(), whole.nbytes());
  int64_t differing = 0;
  for (size_t i = 0; i < streamed.size(); ++i) differing += streamed[i] != bytes[i];
  // A slice from an odd offset across most of the tensor.
  const size_t offset = 2 * 1'000'003;
  HostTensor slice = embed.slice_bytes(offset, {1'500'000}).to_host();
  for (size_t i = 0; i < slice.nbytes(); ++i)
    differing += static_cast<const uint8_t*>(slice.data())[i] != bytes[offset + i];
  std::printf("streamed pieces and slice vs whole tensor: %lld differing bytes\n", static_cast<long long>(differing));
  EXPECT_EQ(differing, 0);
}

TEST(RandomInit, SpecialInitialisations) {
  ModelCheckpoint checkpoint = random_init_checkpoint(model_config_preset("tiny-vl"), 5, DType::bf16);
  auto expect_constant = [&](const std::string& name, double value) {
    Stats s = stats_of(checkpoint.params.at(name));
    EXPECT_EQ(s.min, value) << name;
    EXPECT_EQ(s.max, value) << name;
  };
  const std::string p = "model.language_model.";
  expect_constant(p + "layers.0.input_layernorm.weight", 0.0);
  expect_constant(p + "layers.0.post_attention_layernorm.weight", 0.0);
  expect_constant(p + "norm.weight", 0.0);
  expect_constant(p + "layers.3.self_attn.q_norm.weight", 0.0);
  expect_constant(p + "layers.3.self_attn.k_norm.weight", 0.0);
  expect_constant(p + "layers.0.linear_attn.norm.weight", 1.0);
  expect_constant(p + "layers.0.linear_attn.dt_bias", 1.0);
  expect_constant("model.visual.blocks.0.norm1.weight", 1.0);
  expect_constant("model.visual.blocks.0.norm1.bias", 0.0);
  expect_constant("model.visual.merger.norm.weight", 1.0);
  expect_constant("model.visual.blocks.1.attn.qkv.bias", 0.0);
  expect_constant("model.visual.patch_embed.proj.bias", 0.0);
  const StoredTensor& a_log = checkpoint.params.at(p + "layers.0.linear_attn.A_log");
  EXPECT_EQ(a_log.dtype(), DType::f32);
  Stats s = stats_of(a_log);
  std::printf("A_log: min %.4f max %.4f (range [log 0.01, log 16) = [%.4f, %.4f))\n", s.min, s.max, std::log(0.01),
              std::log(16.0));
  EXPECT_GE(s.min, std::log(0.01));
  EXPECT_LT(s.max, std::log(16.0));
  EXPECT_LT(s.min, s.max);
  Stats router = stats_of(checkpoint.params.at(p + "layers.2.mlp.gate.weight"));
  EXPECT_GT(router.std_dev, 0.01);
}

}  // namespace
}  // namespace deltamoe
