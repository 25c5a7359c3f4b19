// Tests of model checkpoints: load -> save -> load is bitwise identical for both expert layouts,
// single-file and sharded (and the files are byte-identical when the layout is kept); per-expert
// tensors are the right slices of the fused ones; mtp.* passes through; per-tensor dtypes are
// kept; missing / unexpected / wrong-shape keys are reported by name.
#include "checkpoint/model_checkpoint.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <filesystem>

#include "checkpoint/checkpoint_test_util.h"
#include "checkpoint/random_init.h"
#include "checkpoint/sharded.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

// Every regular file of two directories has the same bytes (and both hold the same names).
void expect_same_files(const std::string& a, const std::string& b) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(a)) names.push_back(entry.path().filename().string());
  int other_count = 0;
  for (const auto& entry : fs::directory_iterator(b)) other_count += entry.is_regular_file();
  EXPECT_EQ(static_cast<int>(names.size()), other_count) << a << " vs " << b;
  int64_t differing_bytes = 0;
  for (const std::string& name : names) {
    std::string x = read_file_bytes(a + "/" + name), y = read_file_bytes(b + "/" + name);
    ASSERT_EQ(x.size(), y.size()) << name;
    for (size_t i = 0; i < x.size(); ++i) differing_bytes += x[i] != y[i];
  }
  std::printf("compared %zu files of %s and %s: %lld differing bytes\n", names.size(), a.c_str(), b.c_str(),
              static_cast<long long>(differing_bytes));
  EXPECT_EQ(differing_bytes, 0);
}

// Number of parameters and passthrough tensors whose bytes differ (or that are absent) between two checkpoints.
int count_differences(const ModelCheckpoint& a, const ModelCheckpoint& b) {
  int differences = 0;
  for (const auto* maps : {&a.params, &a.passthrough}) {
    const auto& other = maps == &a.params ? b.params : b.passthrough;
    for (const auto& [name, tensor] : *maps) {
      auto found = other.find(name);
      differences += found == other.end() || !found->second.bitwise_equal(tensor);
    }
  }
  differences += static_cast<int>(a.params.size() != b.params.size() || a.passthrough.size() != b.passthrough.size());
  return differences;
}

HostTensor ramp(DType dtype, Shape shape, float scale) {
  HostTensor f32(DType::f32, shape);
  for (int64_t i = 0; i < shape.numel(); ++i) f32.as<float>()[i] = scale * static_cast<float>(i % 251);
  return dtype == DType::f32 ? f32 : f32.to_dtype(dtype);
}

// A tiny-vl checkpoint with random weights and two mtp.* tensors (one per-expert style, which must
// not be mistaken for a per-expert main-model layout), saved fused in one file.
class CheckpointFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    original_ = random_init_checkpoint(model_config_preset("tiny-vl"), 1234, DType::bf16);
    original_.passthrough["mtp.fc.weight"] = StoredTensor::from_host(ramp(DType::bf16, {64, 128}, 0.01f));
    original_.passthrough["mtp.layers.0.mlp.experts.0.gate_proj.weight"] =
        StoredTensor::from_host(ramp(DType::bf16, {32, 64}, 0.02f));
    SaveOptions single;
    single.max_shard_bytes = 0;
    save_model_dir(original_, dir_.path("a"), single);
  }
  std::string path(const std::string& name) const { return dir_.path(name); }

  ScratchDir dir_{"model_ckpt"};
  ModelCheckpoint original_;
};

TEST_F(CheckpointFixture, FusedSingleFileRoundTripIsBitwiseAndByteIdentical) {
  ModelCheckpoint loaded = load_model_dir(path("a"));
  EXPECT_EQ(loaded.expert_layout, ExpertLayout::fused);
  EXPECT_EQ(loaded.passthrough.size(), 2u);
  EXPECT_EQ(count_differences(original_, loaded), 0);
  SaveOptions single;
  single.max_shard_bytes = 0;
  save_model_dir(loaded, path("b"), single);
  expect_same_files(path("a"), path("b"));
  EXPECT_EQ(count_differences(loaded, load_model_dir(path("b"))), 0);
}

TEST_F(CheckpointFixture, PerTensorDtypesAreKept) {
  ModelCheckpoint loaded = load_model_dir(path("a"));
  EXPECT_EQ(loaded.params.at("model.language_model.layers.0.linear_attn.A_log").dtype(), DType::f32);
  EXPECT_EQ(loaded.params.at("model.language_model.layers.0.linear_attn.dt_bias").dtype(), DType::bf16);
  EXPECT_EQ(loaded.passthrough.at("mtp.fc.weight").dtype(), DType::bf16);
}

TEST_F(CheckpointFixture, PerExpertLayoutRoundTrip) {
  const ModelConfig& config = original_.config;
  const int64_t H = config.text.hidden_size, I = config.text.moe_intermediate_size, E = config.text.num_experts;
  ModelCheckpoint fused = load_model_dir(path("a"));
  SaveOptions per_expert;
  per_expert.expert_layout = ExpertLayout::per_expert;
  per_expert.max_shard_bytes = 0;
  save_model_dir(fused, path("c"), per_expert);

  // On disk: no fused keys, per-expert keys that are the row slices of the fused tensors.
  WeightsDir files = open_weights_dir(path("c"));
  EXPECT_EQ(files.tensors.count(fused_gate_up_name(config, 1)), 0u);
  EXPECT_EQ(files.tensors.count(fused_down_name(config, 1)), 0u);
  HostTensor gate_up = fused.params.at(fused_gate_up_name(config, 1)).to_host();
  HostTensor down = fused.params.at(fused_down_name(config, 1)).to_host();
  int64_t wrong_values = 0;
  for (int64_t e = 0; e < E; ++e) {
    HostTensor gate = files.tensors.at(per_expert_name(config, 1, e, "gate_proj")).to_host();
    HostTensor up = files.tensors.at(per_expert_name(config, 1, e, "up_proj")).to_host();
    HostTensor down_e = files.tensors.at(per_expert_name(config, 1, e, "down_proj")).to_host();
    ASSERT_EQ(gate.shape(), (Shape{I, H}));
    ASSERT_EQ(down_e.shape(), (Shape{H, I}));
    const uint16_t* gu = static_cast<const uint16_t*>(gate_up.data());
    for (int64_t r = 0; r < I; ++r) {
      for (int64_t c = 0; c < H; ++c) {
        wrong_values += static_cast<const uint16_t*>(gate.data())[r * H + c] != gu[(e * 2 * I + r) * H + c];
        wrong_values += static_cast<const uint16_t*>(up.data())[r * H + c] != gu[(e * 2 * I + I + r) * H + c];
      }
    }
    const uint16_t* dn = static_cast<const uint16_t*>(down.data());
    for (int64_t i = 0; i < H * I; ++i)
      wrong_values += static_cast<const uint16_t*>(down_e.data())[i] != dn[e * H * I + i];
  }
  std::printf("per-expert slices of layer 1: %lld wrong values\n", static_cast<long long>(wrong_values));
  EXPECT_EQ(wrong_values, 0);

  ModelCheckpoint reloaded = load_model_dir(path("c"));
  EXPECT_EQ(reloaded.expert_layout, ExpertLayout::per_expert);
  EXPECT_EQ(count_differences(fused, reloaded), 0);
  // The per-expert mtp tensor stays passthrough in either layout.
  EXPECT_EQ(reloaded.passthrough.count("mtp.layers.0.mlp.experts.0.gate_proj.weight"), 1u);
  // Keeping the layout reproduces the files; converting back reproduces the fused original.
  SaveOptions keep;
  keep.max_shard_bytes = 0;
  save_model_dir(reloaded, path("d"), keep);
  expect_same_files(path("c"), path("d"));
  SaveOptions to_fused = keep;
  to_fused.expert_layout = ExpertLayout::fused;
  save_model_dir(reloaded, path("e"), to_fused);
  expect_same_files(path("a"), path("e"));
}

TEST_F(CheckpointFixture, ShardedRoundTripForBothLayouts) {
  ModelCheckpoint loaded = load_model_dir(path("a"));
  for (ExpertLayout layout : {ExpertLayout::fused, ExpertLayout::per_expert}) {
    const std::string name = std::string("sharded_") + expert_layout_name(layout);
    SaveOptions options;
    options.expert_layout = layout;
    options.max_shard_bytes = 300'000;
    save_model_dir(loaded, path(name), options);
    WeightsDir files = open_weights_dir(path(name));
    EXPECT_TRUE(files.sharded);
    EXPECT_GE(files.files.size(), 5u) << "2 MB in 300 kB shards";
    ModelCheckpoint reloaded = load_model_dir(path(name));
    EXPECT_EQ(reloaded.expert_layout, layout);
    EXPECT_EQ(count_differences(loaded, reloaded), 0) << name;
    SaveOptions keep;
    keep.max_shard_bytes = 300'000;
    save_model_dir(reloaded, path(name + "_again"), keep);
    expect_same_files(path(name), path(name + "_again"));
  }
}

// Rewrites the checkpoint in a_dir into out_dir after `edit` changed its tensor list; returns the load error.
std::string write_variant(const std::string& a_dir, const std::string& out_dir,
                          const std::function<void(std::map<std::string, StoredTensor>&)>& edit) {
  WeightsDir weights = open_weights_dir(a_dir);
  std::map<std::string, StoredTensor> tensors = weights.tensors;
  edit(tensors);
  std::vector<NamedTensor> list;
  for (const auto& [name, tensor] : tensors) list.push_back({name, tensor});
  write_weights_dir(out_dir, list, 0);
  fs::copy_file(a_dir + "/config.json", out_dir + "/config.json", fs::copy_options::overwrite_existing);
  return error_of([&] { load_model_dir(out_dir); });
}

void expect_mentions(const std::string& message, const std::vector<std::string>& needles) {
  ASSERT_FALSE(message.empty()) << "expected an error";
  std::printf("error as expected: %s\n", message.c_str());
  for (const std::string& needle : needles) {
    EXPECT_NE(message.find(needle), std::string::npos) << "message lacks '" << needle << "': " << message;
  }
}

TEST_F(CheckpointFixture, MissingKeyIsReportedByName) {
  const std::string key = "model.language_model.layers.2.linear_attn.in_proj_z.weight";
  std::string message = write_variant(path("a"), path("missing"), [&](auto& t) { t.erase(key); });
  expect_mentions(message, {path("missing"), "missing tensors (1)", key});
}

TEST_F(CheckpointFixture, UnexpectedKeyIsReportedByName) {
  const std::string key = "model.language_model.layers.0.mlp.extra_bias";
  std::string message = write_variant(path("a"), path("unexpected"),
                                      [&](auto& t) { t[key] = StoredTensor::from_host(HostTensor(DType::bf16, {4})); });
  expect_mentions(message, {path("unexpected"), "unexpected tensors (1)", key, "model.safetensors"});
}

TEST_F(CheckpointFixture, WrongShapeIsReportedByName) {
  const std::string key = "model.visual.blocks.1.attn.qkv.weight";
  std::string message = write_variant(path("a"), path("shape"), [&](auto& t) {
    t[key] = StoredTensor::from_host(HostTensor(DType::bf16, {64, 64}));
  });
  expect_mentions(message, {"wrong shape", key, "has [64, 64]", "expected [192, 64]"});
}

TEST_F(CheckpointFixture, MissingPerExpertPieceIsReportedByName) {
  ModelCheckpoint loaded = load_model_dir(path("a"));
  SaveOptions per_expert;
  per_expert.expert_layout = ExpertLayout::per_expert;
  per_expert.max_shard_bytes = 0;
  save_model_dir(loaded, path("pe"), per_expert);
  const std::string key = per_expert_name(loaded.config, 3, 5, "up_proj");
  std::string message = write_variant(path("pe"), path("pe_missing"), [&](auto& t) { t.erase(key); });
  expect_mentions(message, {"missing tensors (1)", key});
}

TEST_F(CheckpointFixture, MixedExpertLayoutsAreRejected) {
  const ModelConfig& config = original_.config;
  std::string message = write_variant(path("a"), path("mixed"), [&](auto& t) {
    t[per_expert_name(config, 0, 0, "gate_proj")] = StoredTensor::from_host(HostTensor(DType::bf16, {32, 64}));
  });
  expect_mentions(message, {path("mixed"), "both fused", "per expert"});
}

TEST_F(CheckpointFixture, ReportCollectsEveryProblem) {
  write_variant(path("a"), path("many"), [&](auto& t) {
    t.erase("lm_head.weight");
    t.erase("model.visual.pos_embed.weight");
    t["stray.weight"] = StoredTensor::from_host(HostTensor(DType::f32, {1}));
    t["model.language_model.norm.weight"] = StoredTensor::from_host(HostTensor(DType::i64, {64}));
  });
  CheckpointReport report;
  ModelCheckpoint partial = load_model_dir(path("many"), &report);
  std::printf("%s", report.describe(path("many")).c_str());
  EXPECT_EQ(report.missing, (std::vector<std::string>{"lm_head.weight", "model.visual.pos_embed.weight"}));
  ASSERT_EQ(report.unexpected.size(), 1u);
  EXPECT_NE(report.unexpected[0].find("stray.weight"), std::string::npos);
  ASSERT_EQ(report.wrong_dtype.size(), 1u);
  EXPECT_NE(report.wrong_dtype[0].find("model.language_model.norm.weight"), std::string::npos);
  EXPECT_EQ(partial.params.count("lm_head.weight"), 0u);
}

// A NaN or Inf anywhere in the weights (each floating dtype, parameters and passthrough tensors)
// is refused at load, naming the tensor. (Before: it loaded, and training skipped every step.)
TEST_F(CheckpointFixture, NonFiniteWeightsAreRefusedAtLoadNamingTheTensor) {
  struct Case {
    DType dtype;
    float value;
    bool passthrough;
  };
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<Case> cases = {{DType::bf16, nan, false}, {DType::bf16, -inf, false}, {DType::f32, inf, false},
                                   {DType::f16, nan, false},  {DType::f64, -inf, false},  {DType::bf16, nan, true}};
  for (const Case& c : cases) {
    ModelCheckpoint broken = original_;
    auto& group = c.passthrough ? broken.passthrough : broken.params;
    const std::string name = c.passthrough ? "mtp.fc.weight" : std::next(group.begin(), 3)->first;
    HostTensor values = group.at(name).to_host().to_f32();
    values.as<float>()[values.numel() - 2] = c.value;
    group[name] = StoredTensor::from_host(values.to_dtype(c.dtype));
    fs::remove_all(path("broken"));
    save_model_dir(broken, path("broken"));
    const std::string message = error_of([&] { load_model_dir(path("broken")); });
    std::printf("  %s\n", message.c_str());
    EXPECT_NE(message.find(str_cat("tensor '", name, "'")), std::string::npos) << message;
    EXPECT_NE(message.find(str_cat("holds NaN or Inf (first at element ", values.numel() - 2, ")")), std::string::npos)
        << message;
  }
  // The largest finite values pass.
  ModelCheckpoint extreme = original_;
  const std::string name = extreme.params.begin()->first;
  HostTensor values = extreme.params.at(name).to_host().to_f32();
  for (int64_t i = 0; i < values.numel(); ++i) values.as<float>()[i] = i % 2 ? 3.38e38f : -3.38e38f;
  extreme.params[name] = StoredTensor::from_host(values.to_dtype(DType::bf16));
  save_model_dir(extreme, path("extreme"));
  EXPECT_NO_THROW(load_model_dir(path("extreme")));
}

// The input model's file shrinking under a running job used to make the next save fail with
// "Bad address (disk full?)"; the message now says what happened and names the tensor.
TEST_F(CheckpointFixture, ASourceFileTruncatedAfterLoadingIsNamedWhenSaving) {
  fs::copy(path("a"), path("copy"), fs::copy_options::recursive);
  const ModelCheckpoint loaded = load_model_dir(path("copy"));
  const std::string file = path("copy") + "/model.safetensors";
  fs::resize_file(file, fs::file_size(file) / 2);
  const std::string message = error_of([&] { save_model_dir(loaded, path("saved")); });
  std::printf("  %s\n", message.c_str());
  EXPECT_NE(message.find("can no longer be read: the file they are mapped from (the --model weights?) was truncated"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("the bytes of tensor '"), std::string::npos) << message;
}

TEST_F(CheckpointFixture, SavingAnIncompleteCheckpointIsRefused) {
  ModelCheckpoint loaded = load_model_dir(path("a"));
  loaded.params.erase("lm_head.weight");
  std::string message = error_of([&] { save_model_dir(loaded, path("refused")); });
  expect_mentions(message, {"lacks parameter 'lm_head.weight'"});
}

}  // namespace
}  // namespace deltamoe

namespace deltamoe {
namespace {

// transformers' text-only class also loads files whose text keys sit under model.language_model.*
// (e.g. a VLM checkpoint with a text-only config); we do too, and a save restores that prefix.
TEST(TextOnlyCheckpoint, LanguageModelPrefixLoadsAndIsKeptOnSave) {
  ScratchDir dir("text_prefix");
  ModelCheckpoint original = random_init_checkpoint(model_config_preset("tiny"), 99, DType::bf16);
  original.text_keys_under_language_model = true;
  original.passthrough["model.visual.blocks.0.norm1.weight"] = StoredTensor::from_host(ramp(DType::bf16, {64}, 0.5f));
  SaveOptions single;
  single.max_shard_bytes = 0;
  save_model_dir(original, dir.path("a"), single);
  WeightsDir files = open_weights_dir(dir.path("a"));
  EXPECT_EQ(files.tensors.count("model.language_model.embed_tokens.weight"), 1u);
  EXPECT_EQ(files.tensors.count("model.embed_tokens.weight"), 0u);
  EXPECT_EQ(files.tensors.count("lm_head.weight"), 1u);

  ModelCheckpoint loaded = load_model_dir(dir.path("a"));
  EXPECT_TRUE(loaded.text_keys_under_language_model);
  EXPECT_EQ(loaded.params.count("model.embed_tokens.weight"), 1u);
  EXPECT_EQ(loaded.passthrough.count("model.visual.blocks.0.norm1.weight"), 1u);
  EXPECT_EQ(count_differences(original, loaded), 0);
  save_model_dir(loaded, dir.path("b"), single);
  expect_same_files(dir.path("a"), dir.path("b"));
}

}  // namespace
}  // namespace deltamoe
