// Checks the parity runner on a small random checkpoint: both on-disk expert layouts give the same
// results, the output file holds every gradient under its fused HF name, packed inputs run, and bad
// inputs (text and image ones) are reported by tensor name.
#include "train/parity.h"

#include <gtest/gtest.h>

#include <cstring>

#include "checkpoint/checkpoint_test_util.h"
#include "checkpoint/model_checkpoint.h"
#include "checkpoint/random_init.h"
#include "checkpoint/safetensors.h"
#include "core/rng.h"
#include "model/config.h"

namespace deltamoe {
namespace {

constexpr int64_t kRows = 2, kSeqLen = 11;

ModelConfig small_config() {
  ModelConfig config = model_config_preset("tiny");
  config.text.dtype = "float32";
  return config;
}

HostTensor int64_tensor(const std::vector<int64_t>& values, Shape shape) {
  HostTensor tensor(DType::i64, shape);
  std::memcpy(tensor.data(), values.data(), values.size() * sizeof(int64_t));
  return tensor;
}

HostTensor int32_tensor(const std::vector<int32_t>& values, Shape shape) {
  HostTensor tensor(DType::i32, shape);
  std::memcpy(tensor.data(), values.data(), values.size() * sizeof(int32_t));
  return tensor;
}

std::vector<int64_t> random_tokens(uint64_t seed, int64_t count, int64_t vocab) {
  Rng rng(seed);
  std::vector<int64_t> ids(count);
  for (auto& id : ids) id = static_cast<int64_t>(rng.below(vocab));
  return ids;
}

void write_inputs(const std::string& path, const std::vector<NamedTensor>& tensors) {
  write_safetensors(path, tensors);
}

std::vector<NamedTensor> row_inputs(int64_t vocab) {
  std::vector<int64_t> labels = random_tokens(2, kRows * kSeqLen, vocab);
  labels[3] = labels[15] = -100;
  return {
      {"input_ids", StoredTensor::from_host(int64_tensor(random_tokens(1, kRows * kSeqLen, vocab), {kRows, kSeqLen}))},
      {"labels", StoredTensor::from_host(int64_tensor(labels, {kRows, kSeqLen}))}};
}

class ParityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const ModelConfig config = small_config();
    const ModelCheckpoint random = random_init_checkpoint(config, 7, DType::f32);
    save_model_dir(random, dir_.path("fused"), SaveOptions{ExpertLayout::fused, 0});
    save_model_dir(random, dir_.path("per_expert"), SaveOptions{ExpertLayout::per_expert, 0});
    write_inputs(dir_.path("rows.safetensors"), row_inputs(config.text.vocab_size));
  }
  ScratchDir dir_{"parity_test"};
};

TEST_F(ParityTest, ExpertLayoutsGiveIdenticalResultsAndOutputsHoldFusedNames) {
  const ParityInputs inputs = load_parity_inputs(dir_.path("rows.safetensors"));
  const ModelCheckpoint fused = load_model_dir(dir_.path("fused"));
  const ModelCheckpoint per_expert = load_model_dir(dir_.path("per_expert"));
  ASSERT_EQ(per_expert.expert_layout, ExpertLayout::per_expert);
  const ParityResult a = run_parity_cpu(fused, inputs), b = run_parity_cpu(per_expert, inputs);
  std::printf("  ce_loss %.8f / %.8f, aux_loss %.8f / %.8f\n", a.ce_loss, b.ce_loss, a.aux_loss, b.aux_loss);
  EXPECT_EQ(a.ce_loss, b.ce_loss);
  EXPECT_EQ(a.aux_loss, b.aux_loss);
  EXPECT_EQ(std::memcmp(a.logits.data(), b.logits.data(), a.logits.nbytes()), 0);
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (const auto& [name, grad] : a.grads)
    EXPECT_EQ(std::memcmp(grad.data(), b.grads.at(name).data(), grad.nbytes()), 0) << name;

  write_parity_outputs(dir_.path("out.safetensors"), a);
  const auto out = SafetensorsFile::open(dir_.path("out.safetensors"));
  EXPECT_EQ(out->find("ce_loss")->shape.rank(), 0);
  EXPECT_EQ(out->find("logits")->shape, (Shape{kRows, kSeqLen, fused.config.text.vocab_size}));
  const TextConfig& t = fused.config.text;
  const SafetensorsEntry* gate_up = out->find("grad.model.layers.0.mlp.experts.gate_up_proj");
  ASSERT_NE(gate_up, nullptr);
  EXPECT_EQ(gate_up->shape, (Shape{t.num_experts, 2 * t.moe_intermediate_size, t.hidden_size}));
  ASSERT_NE(out->find("grad_aux.model.layers.3.self_attn.q_proj.weight"), nullptr);
  EXPECT_EQ(out->find("grad_aux.lm_head.weight")->dtype, DType::f32);
  size_t grads = 0;
  for (const auto& entry : out->entries()) grads += entry.name.rfind("grad.", 0) == 0 ? 1 : 0;
  EXPECT_EQ(grads, a.grads.size());
}

TEST_F(ParityTest, PackedInputsRun) {
  const int64_t vocab = small_config().text.vocab_size, total = 20;
  std::vector<int64_t> labels = random_tokens(4, total, vocab);
  labels[0] = labels[7] = -100;  // first label of each packed sequence
  write_inputs(dir_.path("packed.safetensors"),
               {{"input_ids", StoredTensor::from_host(int64_tensor(random_tokens(3, total, vocab), {1, total}))},
                {"labels", StoredTensor::from_host(int64_tensor(labels, {1, total}))},
                {"cu_seqlens", StoredTensor::from_host(int32_tensor({0, 7, 20}, {3}))}});
  const ParityResult result =
      run_parity_cpu(load_model_dir(dir_.path("fused")), load_parity_inputs(dir_.path("packed.safetensors")));
  std::printf("  packed ce_loss %.6f aux_loss %.6f\n", result.ce_loss, result.aux_loss);
  EXPECT_GT(result.ce_loss, 0.0);
  EXPECT_GT(result.aux_loss, 0.0);
}

TEST_F(ParityTest, BadInputsNameTheTensor) {
  const ModelCheckpoint checkpoint = load_model_dir(dir_.path("fused"));
  const int64_t vocab = checkpoint.config.text.vocab_size;
  auto error_for = [&](const std::vector<NamedTensor>& tensors) {
    write_inputs(dir_.path("bad.safetensors"), tensors);
    return error_of([&] { run_parity_cpu(checkpoint, load_parity_inputs(dir_.path("bad.safetensors"))); });
  };
  const auto ids = StoredTensor::from_host(int64_tensor(random_tokens(1, 6, vocab), {1, 6}));
  const auto labels = StoredTensor::from_host(int64_tensor(random_tokens(2, 6, vocab), {1, 6}));
  std::string message = error_for({{"input_ids", ids}});
  std::printf("  %s\n", message.c_str());
  EXPECT_NE(message.find("'labels' is missing"), std::string::npos);
  message =
      error_for({{"input_ids", ids}, {"labels", StoredTensor::from_host(int32_tensor({1, 2, 3, 4, 5, 6}, {1, 6}))}});
  std::printf("  %s\n", message.c_str());
  EXPECT_NE(message.find("'labels' is I32, expected I64"), std::string::npos);
  message = error_for(
      {{"input_ids", ids}, {"labels", labels}, {"cu_seqlens", StoredTensor::from_host(int32_tensor({0, 4}, {2}))}});
  std::printf("  %s\n", message.c_str());
  EXPECT_NE(message.find("cu_seqlens must end at the token count 6"), std::string::npos);
  message = error_for(
      {{"input_ids", StoredTensor::from_host(int64_tensor({1, 2, 3, vocab + 5, 1, 1}, {1, 6}))}, {"labels", labels}});
  std::printf("  %s\n", message.c_str());
  EXPECT_NE(message.find("outside the vocabulary"), std::string::npos);
  message =
      error_for({{"input_ids", ids}, {"labels", StoredTensor::from_host(int64_tensor({1, 2, -7, 4, 5, 6}, {1, 6}))}});
  std::printf("  %s\n", message.c_str());
  EXPECT_NE(message.find("label -7"), std::string::npos);
}

TEST_F(ParityTest, BadImageInputsSayWhatIsWrong) {
  ModelConfig vl_config = model_config_preset("tiny-vl");
  const ModelCheckpoint vl = random_init_checkpoint(vl_config, 3, DType::f32);
  const ModelCheckpoint text = load_model_dir(dir_.path("fused"));
  const int64_t pad = vl_config.image_token_id, patch_dim = vl_config.vision.patch_dim();
  // One (1, 4, 4) image: 16 patches, 4 merged tokens.
  ParityInputs good;
  good.input_ids = int64_tensor({5, 6, pad, pad, pad, pad, 7, 8}, {1, 8});
  good.labels = int64_tensor({5, 6, -100, -100, -100, -100, 7, 8}, {1, 8});
  good.pixel_values = HostTensor::from_f32(std::vector<float>(16 * patch_dim, 0.25f), Shape{16, patch_dim});
  good.image_grid_thw = int64_tensor({1, 4, 4}, {1, 3});
  good.mm_token_type_ids = int64_tensor({0, 0, 1, 1, 1, 1, 0, 0}, {1, 8});
  EXPECT_GT(run_parity_cpu(vl, good).grads.count("model.visual.merger.linear_fc2.weight"), 0u);
  auto expect_error = [&](const ModelCheckpoint& checkpoint, const ParityInputs& inputs, const std::string& part) {
    const std::string message = error_of([&] { run_parity_cpu(checkpoint, inputs); });
    std::printf("  %s\n", message.c_str());
    EXPECT_NE(message.find(part), std::string::npos) << message;
  };
  expect_error(text, good, "has no vision tower");
  ParityInputs bad = good;
  bad.image_grid_thw.reset();
  expect_error(vl, bad, "pixel_values and image_grid_thw together");
  bad = good;
  bad.mm_token_type_ids = int64_tensor({0, 0, 1, 1, 1, 0, 0, 0}, {1, 8});
  expect_error(vl, bad, "mm_token_type_ids[0, 5] is 0");
  bad = good;
  bad.pixel_values = HostTensor::from_f32(std::vector<float>(16 * 10, 0.0f), Shape{16, 10});
  expect_error(vl, bad, "must have 1536 columns");
  bad = good;
  bad.input_ids = int64_tensor({5, 6, pad, pad, pad, 9, 7, 8}, {1, 8});
  bad.mm_token_type_ids.reset();
  expect_error(vl, bad, "3 tokens of id 4075 but 4 feature rows");  // one <|image_pad|> short
  bad = good;
  bad.image_grid_thw = int64_tensor({1, 4, 8}, {1, 3});
  expect_error(vl, bad, "pixel_values must be [32, 1536] for image_grid_thw, got [16, 1536]");
}

}  // namespace
}  // namespace deltamoe
