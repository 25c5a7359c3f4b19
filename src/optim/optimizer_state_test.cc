// Tests of the optimizer-state file: bitwise round trip (f32 and bf16 moments), the
// safetensors layout read back by hand, and clear errors for truncated, corrupt, foreign and
// mismatched files.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "optim/optimizer_state.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

std::vector<float> random_values(int64_t count, uint64_t seed, double scale) {
  Rng rng(seed);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) value = static_cast<float>(rng.normal() * scale);
  return values;
}

ParamLayout make_layout() {
  ParamLayout layout;
  layout.add("model.embed_tokens.weight", {11, 6});
  layout.add("model.norm.weight", {6});
  layout.add("model.layers.0.mlp.experts.gate_up_proj", {4, 12, 6});
  return layout;
}

class OptimizerStateFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("deltamoe_optim_state_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // An optimizer after a few steps, its master weights, and the file they were saved to.
  std::string save_trained(DType moment_dtype, std::vector<float>* master, AdamW** out_optimizer) {
    AdamWConfig config;
    config.moment_dtype = moment_dtype;
    trained_ = std::make_unique<AdamW>(make_layout(), config);
    *master = random_values(trained_->range().size(), 1, 1.0);
    for (int step = 0; step < 3; ++step) {
      std::vector<float> grad = random_values(trained_->range().size(), 10 + static_cast<uint64_t>(step), 0.1);
      trained_->step(1e-3, master->data(), grad.data());
    }
    const std::string file = path("state.safetensors");
    save_optimizer_state(file, *trained_, OptimizerProgress{4, 1}, master->data());
    *out_optimizer = trained_.get();
    return file;
  }

  static std::string read_bytes(const std::string& file) {
    std::ifstream in(file, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  static void write_bytes(const std::string& file, const std::string& bytes) {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }

  // Loading file into a fresh optimizer fails with a message containing every part of expected.
  void expect_load_error(const std::string& file, const std::vector<std::string>& expected,
                         const AdamWConfig& config = AdamWConfig{}) {
    AdamW fresh(make_layout(), config);
    std::vector<float> master(static_cast<size_t>(fresh.range().size()));
    try {
      load_optimizer_state(file, &fresh, master.data());
      ADD_FAILURE() << "loading " << file << " did not fail";
    } catch (const Error& error) {
      std::printf("expected error: %s\n", error.what());
      for (const std::string& part : expected) {
        EXPECT_NE(std::string(error.what()).find(part), std::string::npos) << "message: " << error.what();
      }
    }
  }

  fs::path dir_;
  std::unique_ptr<AdamW> trained_;
};

TEST_F(OptimizerStateFile, RoundTripIsBitwise) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    std::vector<float> master;
    AdamW* trained = nullptr;
    const std::string file = save_trained(dtype, &master, &trained);
    AdamWConfig config;
    config.moment_dtype = dtype;
    AdamW fresh(make_layout(), config);
    std::vector<float> loaded_master(master.size(), -1.0f);
    OptimizerProgress progress = load_optimizer_state(file, &fresh, loaded_master.data());
    EXPECT_EQ(progress.schedule_step, 4);
    EXPECT_EQ(progress.skipped_steps, 1);
    EXPECT_EQ(fresh.adam_step(), 3);
    EXPECT_EQ(fresh.exp_avg_bytes(), trained->exp_avg_bytes()) << dtype_name(dtype);
    EXPECT_EQ(fresh.exp_avg_sq_bytes(), trained->exp_avg_sq_bytes()) << dtype_name(dtype);
    EXPECT_EQ(0, std::memcmp(loaded_master.data(), master.data(), master.size() * sizeof(float)));
    // The moments are not trivially zero, so the comparison above meant something.
    EXPECT_NE(fresh.exp_avg_f32()[0], 0.0f);
    // Loading without master weights is allowed too.
    AdamW fresh_without_master(make_layout(), config);
    load_optimizer_state(file, &fresh_without_master, nullptr);
    EXPECT_EQ(fresh_without_master.exp_avg_bytes(), trained->exp_avg_bytes());
  }
}

TEST_F(OptimizerStateFile, IsASafetensorsFile) {
  std::vector<float> master;
  AdamW* trained = nullptr;
  const std::string file = save_trained(DType::bf16, &master, &trained);
  const std::string bytes = read_bytes(file);
  uint64_t header_size = 0;
  for (int i = 0; i < 8; ++i) header_size |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[static_cast<size_t>(i)])) << (8 * i);
  EXPECT_EQ(header_size % 8, 0u);
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, header_size));
  EXPECT_EQ(header["exp_avg"]["dtype"], "BF16");
  EXPECT_EQ(header["master_weights"]["dtype"], "F32");
  EXPECT_EQ(header["__metadata__"]["adam_step"], "3");
  const uint64_t begin = header["exp_avg_sq"]["data_offsets"][0];
  const uint64_t end = header["exp_avg_sq"]["data_offsets"][1];
  ASSERT_EQ(end - begin, trained->exp_avg_sq_bytes().size());
  EXPECT_EQ(0, std::memcmp(bytes.data() + 8 + header_size + begin, trained->exp_avg_sq().data, end - begin));
  EXPECT_EQ(bytes.size(), 8 + header_size + header["master_weights"]["data_offsets"][1].get<uint64_t>());
  EXPECT_FALSE(fs::exists(file + ".tmp"));
}

TEST_F(OptimizerStateFile, TruncatedFilesAreClearErrors) {
  std::vector<float> master;
  AdamW* trained = nullptr;
  const std::string file = save_trained(DType::f32, &master, &trained);
  const std::string bytes = read_bytes(file);
  const std::string cut = path("cut.safetensors");
  for (size_t keep : {size_t{0}, size_t{5}, size_t{8}, size_t{60}, bytes.size() / 2, bytes.size() - 1}) {
    write_bytes(cut, bytes.substr(0, keep));
    expect_load_error(cut, {cut});
  }
  write_bytes(cut, bytes.substr(0, bytes.size() - 1));
  expect_load_error(cut, {"truncated", "master_weights"});
}

TEST_F(OptimizerStateFile, CorruptionIsDetected) {
  std::vector<float> master;
  AdamW* trained = nullptr;
  const std::string file = save_trained(DType::f32, &master, &trained);
  std::string bytes = read_bytes(file);
  // One flipped bit in the last tensor's data.
  std::string flipped = bytes;
  flipped[flipped.size() - 7] ^= 0x10;
  const std::string bad = path("bad.safetensors");
  write_bytes(bad, flipped);
  expect_load_error(bad, {"master_weights", "checksum"});
  // A changed counter in the metadata (same length, so the JSON stays valid).
  std::string edited = bytes;
  const size_t at = edited.find("\"adam_step\":\"3\"");
  ASSERT_NE(at, std::string::npos);
  edited[at + 13] = '2';
  write_bytes(bad, edited);
  expect_load_error(bad, {"metadata checksum"});
  // Not an optimizer state at all.
  write_bytes(bad, "this is a text file, not a state file at all");
  expect_load_error(bad, {bad});
  expect_load_error(path("does_not_exist.safetensors"), {"does_not_exist"});
}

TEST_F(OptimizerStateFile, MismatchedRunsAreRefused) {
  std::vector<float> master;
  AdamW* trained = nullptr;
  const std::string file = save_trained(DType::f32, &master, &trained);
  AdamWConfig bf16_config;
  bf16_config.moment_dtype = DType::bf16;
  expect_load_error(file, {"f32", "bf16"}, bf16_config);

  ParamLayout other = make_layout();
  other.add("lm_head.weight", {11, 6});
  AdamW bigger(other, AdamWConfig{});
  try {
    load_optimizer_state(file, &bigger, nullptr);
    ADD_FAILURE() << "a different layout was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("3 parameter tensors"), std::string::npos) << error.what();
  }
  ParamLayout renamed;
  renamed.add("model.embed_tokens.weight", {11, 6});
  renamed.add("model.final_norm.weight", {6});
  renamed.add("model.layers.0.mlp.experts.gate_up_proj", {4, 12, 6});
  AdamW renamed_optimizer(renamed, AdamWConfig{});
  try {
    load_optimizer_state(file, &renamed_optimizer, nullptr);
    ADD_FAILURE() << "a renamed parameter was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("model.final_norm.weight"), std::string::npos) << error.what();
  }
  ParamLayout layout = make_layout();
  AdamW shard(layout, AdamWConfig{}, shard_range(layout.total_numel(), 0, 2));
  EXPECT_THROW(load_optimizer_state(file, &shard, nullptr), Error);

  // A file saved without master weights cannot restore them.
  const std::string no_master = path("no_master.safetensors");
  save_optimizer_state(no_master, *trained, OptimizerProgress{3, 0}, nullptr);
  expect_load_error(no_master, {"no master weights"});
  // Writing into a missing directory is a clear error too.
  EXPECT_THROW(save_optimizer_state(path("missing_dir/state.safetensors"), *trained, OptimizerProgress{}, nullptr),
               Error);
}

TEST_F(OptimizerStateFile, EmptyShardRoundTrips) {
  // More ranks than elements leaves some ranks an empty range; they still step and save.
  ParamLayout layout;
  layout.add("w", {2});
  AdamW empty(layout, AdamWConfig{}, shard_range(layout.total_numel(), 3, 4));
  ASSERT_EQ(empty.range().size(), 0);
  empty.step(1e-3, nullptr, nullptr);
  EXPECT_EQ(empty.adam_step(), 1);
  const std::string file = path("empty.safetensors");
  save_optimizer_state(file, empty, OptimizerProgress{1, 0}, nullptr);
  AdamW fresh(layout, AdamWConfig{}, shard_range(layout.total_numel(), 3, 4));
  EXPECT_EQ(load_optimizer_state(file, &fresh, nullptr).schedule_step, 1);
  EXPECT_EQ(fresh.adam_step(), 1);
}

}  // namespace
}  // namespace deltamoe
