// Tests of the optimizer-state file: bitwise round trip (f32 and bf16 moments, whole tensors and
// pieces), the safetensors layout read back by hand, streaming through a staging buffer smaller
// than a record, and clear errors for truncated, corrupt, foreign and mismatched files.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "optim/checksum.h"
#include "optim/host_train_state.h"
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

  // A state after a few steps, and the file it was saved to.
  std::string save_trained(DType moment_dtype, const ParamLayout& layout = make_layout()) {
    AdamWConfig config;
    config.moment_dtype = moment_dtype;
    trained_ = std::make_unique<HostTrainState>(layout, config);
    trained_->master() = random_values(layout.total_numel(), 1, 1.0);
    for (int step = 0; step < 3; ++step) {
      std::vector<float> grad = random_values(layout.total_numel(), 10 + static_cast<uint64_t>(step), 0.1);
      trained_->optimizer().step(1e-3, trained_->master().data(), grad.data());
    }
    const std::string file = path("state.safetensors");
    save_optimizer_state(file, *trained_, OptimizerProgress{4, 1});
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

  // Loading file into a fresh state fails with a message containing every part of expected.
  void expect_load_error(const std::string& file, const std::vector<std::string>& expected,
                         const AdamWConfig& config = AdamWConfig{}, const ParamLayout& layout = make_layout()) {
    HostTrainState fresh(layout, config);
    try {
      load_optimizer_state(file, &fresh);
      ADD_FAILURE() << "loading " << file << " did not fail";
    } catch (const Error& error) {
      std::printf("expected error: %s\n", error.what());
      for (const std::string& part : expected) {
        EXPECT_NE(std::string(error.what()).find(part), std::string::npos) << "message: " << error.what();
      }
    }
  }

  fs::path dir_;
  std::unique_ptr<HostTrainState> trained_;
};

TEST_F(OptimizerStateFile, RoundTripIsBitwise) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    const std::string file = save_trained(dtype);
    AdamWConfig config;
    config.moment_dtype = dtype;
    HostTrainState fresh(make_layout(), config);
    std::fill(fresh.master().begin(), fresh.master().end(), -1.0f);
    OptimizerProgress progress = load_optimizer_state(file, &fresh);
    EXPECT_EQ(progress.schedule_step, 4);
    EXPECT_EQ(progress.skipped_steps, 1);
    EXPECT_EQ(fresh.adam_step(), 3);
    EXPECT_EQ(fresh.optimizer().exp_avg_bytes(), trained_->optimizer().exp_avg_bytes()) << dtype_name(dtype);
    EXPECT_EQ(fresh.optimizer().exp_avg_sq_bytes(), trained_->optimizer().exp_avg_sq_bytes()) << dtype_name(dtype);
    // Padding between pieces is not saved; the pieces' values are.
    const ParamLayout layout = make_layout();
    for (const ParamEntry& e : layout.entries()) {
      EXPECT_EQ(0, std::memcmp(fresh.master().data() + e.offset, trained_->master().data() + e.offset,
                               static_cast<size_t>(e.numel) * sizeof(float))) << e.name;
    }
    // The moments are not trivially zero, so the comparison above meant something.
    EXPECT_NE(fresh.optimizer().exp_avg_f32()[0], 0.0f);
  }
}

TEST_F(OptimizerStateFile, PiecesRestoreFromWholeTensorsAndBack) {
  const std::string whole = save_trained(DType::f32);
  // Two pieces per tensor (as two ranks of a ZeRO split would hold), filled from the whole file.
  const ParamLayout tensors = make_layout();
  ParamLayout pieces;
  for (const ParamEntry& e : tensors.entries()) {
    pieces.add_piece(e.name, e.shape, 0, e.numel / 2);
    pieces.add_piece(e.name, e.shape, e.numel / 2, e.numel);
  }
  HostTrainState split(pieces, AdamWConfig{});
  load_optimizer_state(whole, &split);
  for (int i = 0; i < pieces.num_tensors(); ++i) {
    const ParamEntry& p = pieces.entry(i);
    const ParamEntry& w = tensors.entry(tensors.find(p.name));
    EXPECT_EQ(0, std::memcmp(split.master().data() + p.offset, trained_->master().data() + w.offset + p.tensor_begin,
                             static_cast<size_t>(p.numel) * 4)) << p.name << " piece " << p.tensor_begin;
  }
  // ... and saved again as pieces, they restore the whole tensors bit for bit.
  const std::string file = path("pieces.safetensors");
  save_optimizer_state(file, split, OptimizerProgress{4, 1});
  HostTrainState fresh(make_layout(), AdamWConfig{});
  load_optimizer_state(file, &fresh);
  EXPECT_EQ(fresh.optimizer().exp_avg_bytes(), trained_->optimizer().exp_avg_bytes());
  EXPECT_EQ(fresh.optimizer().exp_avg_sq_bytes(), trained_->optimizer().exp_avg_sq_bytes());
  // A file that covers only half of a tensor cannot restore the whole of it.
  ParamLayout half;
  for (const ParamEntry& e : tensors.entries()) half.add_piece(e.name, e.shape, 0, e.numel / 2);
  HostTrainState half_state(half, AdamWConfig{});
  const std::string half_file = path("half.safetensors");
  save_optimizer_state(half_file, half_state, OptimizerProgress{});
  expect_load_error(half_file, {"covers", "model.embed_tokens.weight"});
}

TEST_F(OptimizerStateFile, StreamsRecordsLargerThanTheStagingBuffer) {
  // 20 M fp32 elements: 80 MB per record, above the 64 MiB staging buffer.
  ParamLayout layout;
  layout.add("big", {20'000'000});
  HostTrainState state(layout, AdamWConfig{});
  for (size_t i = 0; i < state.master().size(); ++i) state.master()[i] = static_cast<float>(i % 1000) * 0.5f;
  const std::string file = path("big.safetensors");
  save_optimizer_state(file, state, OptimizerProgress{});
  EXPECT_EQ(fs::file_size(file), optimizer_state_file_bytes(state) - 64);
  HostTrainState fresh(layout, AdamWConfig{});
  load_optimizer_state(file, &fresh);
  EXPECT_TRUE(fresh.master() == state.master());
}

TEST_F(OptimizerStateFile, IsASafetensorsFile) {
  const std::string file = save_trained(DType::bf16);
  const std::string bytes = read_bytes(file);
  uint64_t header_size = 0;
  for (int i = 0; i < 8; ++i) header_size |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[static_cast<size_t>(i)])) << (8 * i);
  EXPECT_EQ(header_size % 8, 0u);
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, header_size));
  const std::string gate_up = "model.layers.0.mlp.experts.gate_up_proj";
  EXPECT_EQ(header["exp_avg/" + gate_up + "/0:288"]["dtype"], "BF16");
  EXPECT_EQ(header["master/model.norm.weight/0:6"]["dtype"], "F32");
  EXPECT_EQ(header["__metadata__"]["adam_step"], "3");
  const nlohmann::json& record = header["exp_avg_sq/" + gate_up + "/0:288"];
  const uint64_t begin = record["data_offsets"][0];
  const uint64_t end = record["data_offsets"][1];
  const ParamEntry& e = trained_->layout().entry(trained_->layout().find(gate_up));
  ASSERT_EQ(end - begin, static_cast<uint64_t>(e.numel) * 2);
  EXPECT_EQ(0, std::memcmp(bytes.data() + 8 + header_size + begin,
                           static_cast<const uint8_t*>(trained_->optimizer().exp_avg_sq().data) + e.offset * 2,
                           end - begin));
  EXPECT_FALSE(fs::exists(file + ".tmp"));
}

TEST_F(OptimizerStateFile, TruncatedFilesAreClearErrors) {
  const std::string file = save_trained(DType::f32);
  const std::string bytes = read_bytes(file);
  const std::string cut = path("cut.safetensors");
  for (size_t keep : {size_t{0}, size_t{5}, size_t{8}, size_t{60}, bytes.size() / 2, bytes.size() - 1}) {
    write_bytes(cut, bytes.substr(0, keep));
    expect_load_error(cut, {cut});
  }
  write_bytes(cut, bytes.substr(0, bytes.size() - 1));
  expect_load_error(cut, {"truncated", "exp_avg_sq/"});
}

TEST_F(OptimizerStateFile, CorruptionIsDetected) {
  const std::string file = save_trained(DType::f32);
  std::string bytes = read_bytes(file);
  // One flipped bit in the last record's data.
  std::string flipped = bytes;
  flipped[flipped.size() - 7] ^= 0x10;
  const std::string bad = path("bad.safetensors");
  write_bytes(bad, flipped);
  expect_load_error(bad, {"exp_avg_sq/", "checksum"});
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
  const std::string file = save_trained(DType::f32);
  AdamWConfig bf16_config;
  bf16_config.moment_dtype = DType::bf16;
  expect_load_error(file, {"f32", "bf16"}, bf16_config);

  ParamLayout bigger = make_layout();
  bigger.add("lm_head.weight", {11, 6});
  expect_load_error(file, {"no state for 'lm_head.weight'"}, AdamWConfig{}, bigger);
  ParamLayout renamed;
  renamed.add("model.embed_tokens.weight", {11, 6});
  renamed.add("model.final_norm.weight", {6});
  renamed.add("model.layers.0.mlp.experts.gate_up_proj", {4, 12, 6});
  expect_load_error(file, {"model.final_norm.weight"}, AdamWConfig{}, renamed);
  ParamLayout smaller;
  smaller.add("model.embed_tokens.weight", {11, 6});
  smaller.add("model.layers.0.mlp.experts.gate_up_proj", {4, 12, 6});
  expect_load_error(file, {"model.norm.weight", "does not train"}, AdamWConfig{}, smaller);
  ParamLayout reshaped;
  reshaped.add("model.embed_tokens.weight", {6, 11});
  reshaped.add("model.norm.weight", {6});
  reshaped.add("model.layers.0.mlp.experts.gate_up_proj", {4, 12, 6});
  expect_load_error(file, {"different model", "model.embed_tokens.weight"}, AdamWConfig{}, reshaped);

  // Writing into a missing directory is a clear error, and leaves no temporary file.
  EXPECT_THROW(save_optimizer_state(path("missing_dir/state.safetensors"), *trained_, OptimizerProgress{}), Error);
}

// A store whose reads fail half-way, as a device copy or a full disk would.
class FailingStore : public HostTrainState {
 public:
  using HostTrainState::HostTrainState;
  void read_state(StateKind kind, int index, int64_t first, int64_t count, void* host) const override {
    if (kind == StateKind::exp_avg) RAISE("simulated read failure");
    HostTrainState::read_state(kind, index, first, count, host);
  }
};

TEST_F(OptimizerStateFile, AFailedSaveLeavesNoTemporaryFile) {
  FailingStore failing(make_layout(), AdamWConfig{});
  const std::string file = path("failed.safetensors");
  EXPECT_THROW(save_optimizer_state(file, failing, OptimizerProgress{}), Error);
  EXPECT_FALSE(fs::exists(file));
  EXPECT_FALSE(fs::exists(file + ".tmp"));
}

TEST(Checksum64Stream, EqualsTheOneShotChecksum) {
  std::vector<uint8_t> bytes(1000);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 37 + 11);
  for (size_t split : {size_t{0}, size_t{1}, size_t{3}, size_t{8}, size_t{13}, size_t{999}, size_t{1000}}) {
    Checksum64 streamed;
    streamed.update(bytes.data(), split);
    for (size_t i = split; i < bytes.size(); i += 5) streamed.update(bytes.data() + i, std::min<size_t>(5, bytes.size() - i));
    EXPECT_EQ(streamed.finish(), checksum64(bytes.data(), bytes.size())) << "split " << split;
  }
}

}  // namespace
}  // namespace deltamoe
