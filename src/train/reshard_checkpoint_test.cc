// Checkpoints across world sizes on the CPU engine: the state of a
// 4-rank job (EP 4, ZeRO-2) gathered and saved is read back at 2 ranks and at 1 with every logical
// tensor (master, exp_avg, exp_avg_sq) bitwise equal, and a 2-rank run saved and resumed continues
// bitwise like the uninterrupted 2-rank run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>

#include "optim/optimizer_state.h"
#include "parallel/thread_comm.h"
#include "train/cpu_engine.h"
#include "train/gathered_state.h"
#include "train/parallel_test_util.h"

namespace deltamoe {
namespace {

using namespace parallel_test;
namespace fs = std::filesystem;

// Every tensor's master and moments as bytes, by "kind/name".
using Logical = std::map<std::string, std::vector<uint8_t>>;

Logical logical_state(const TrainStateStore& state) {
  Logical out;
  const ParamLayout& layout = state.layout();
  for (const StateKind kind : kStateKinds) {
    const size_t element = dtype_size(state_dtype(kind, state.adamw_config()));
    for (int i = 0; i < layout.num_tensors(); ++i) {
      const ParamEntry& entry = layout.entry(i);
      EXPECT_TRUE(entry.is_whole_tensor());
      std::vector<uint8_t>& bytes = out[str_cat(state_kind_name(kind), "/", entry.name)];
      bytes.resize(static_cast<size_t>(entry.numel) * element);
      state.read_state(kind, i, 0, entry.numel, bytes.data());
    }
  }
  return out;
}

int64_t count_different(const Logical& a, const Logical& b) {
  EXPECT_EQ(a.size(), b.size());
  int64_t different = 0;
  for (const auto& [key, bytes] : a) {
    auto it = b.find(key);
    if (it == b.end() || it->second.size() != bytes.size()) {
      ADD_FAILURE() << key << " missing or resized";
      continue;
    }
    different += std::memcmp(bytes.data(), it->second.data(), bytes.size()) != 0;
  }
  return different;
}

class ReshardCheckpoint : public ::testing::Test {
 protected:
  static constexpr int64_t kPerStep = 4;  // micro-batches per global step
  void SetUp() override {
    setup_ = make_setup("tiny-vl", true, false, kPerStep, 4);
    dir_ = fs::temp_directory_path() / str_cat("deltamoe_reshard_", ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  ParallelOptions layout(int world, int ep) const {
    ParallelOptions options;
    options.expert_parallel_size = ep > 0 ? ep : world;
    options.distributed_optimizer = true;
    options.bucket_elements = 30000;
    return options;
  }
  std::vector<MicroBatch> share(int step, int world, int rank) const {
    std::vector<MicroBatch> mine;
    for (int64_t g = 0; g < kPerStep / world; ++g) mine.push_back(setup_.batches[step * kPerStep + g * world + rank]);
    return mine;
  }
  // On `world` ranks: optionally resume from `load`, train steps [first, last), then gather the
  // state and (if `save` is set) save it. Returns the gathered logical state.
  // ep: expert-parallel size (0: the world size).
  Logical run(int world, const std::string& load, int first, int last, const std::string& save, int ep = 0) {
    Logical result;
    run_thread_comm(world, [&](Communicator& comm) {
      CpuEngine engine(setup_.checkpoint, setup_.options, &comm, layout(world, ep));
      if (!load.empty()) {
        const OptimizerProgress progress = load_optimizer_state(load, &engine.state(), &engine.full_layout());
        EXPECT_EQ(progress.schedule_step, first);
      }
      for (int step = first; step < last; ++step) engine.train_step(share(step, world, comm.rank()), 1e-3, 0.5);
      std::unique_ptr<HostTrainState> gathered = gather_train_state(comm, engine.state(), engine.full_layout());
      if (comm.rank() != 0) return;
      if (!save.empty()) save_optimizer_state(save, *gathered, OptimizerProgress{last, 0});
      result = logical_state(*gathered);
    });
    return result;
  }

  parallel_test::Setup setup_;
  fs::path dir_;
};

TEST_F(ReshardCheckpoint, SavedAtFourRanksResumesAtTwoAndOneBitwise) {
  const std::string at_four = (dir_ / "four.safetensors").string();
  const Logical saved = run(4, "", 0, 2, at_four);
  // Read back at 2 ranks (each restores only its pieces) and gathered again.
  const Logical at_two = run(2, at_four, 2, 2, "");
  // ... and at 1 rank by the plain engine.
  CpuEngine one(setup_.checkpoint, setup_.options);
  load_optimizer_state(at_four, &one.state());
  const Logical at_one = logical_state(one.state());
  const int64_t differ_two = count_different(at_two, saved), differ_one = count_different(at_one, saved);
  std::printf("  %zu logical tensors saved at 4 ranks; read at 2 ranks: %lld differ, at 1 rank: %lld differ\n",
              saved.size(), static_cast<long long>(differ_two), static_cast<long long>(differ_one));
  EXPECT_EQ(differ_two, 0);
  EXPECT_EQ(differ_one, 0);
  // A control: the saved state did move away from the initial weights.
  CpuEngine initial(setup_.checkpoint, setup_.options);
  EXPECT_GT(count_different(logical_state(initial.state()), saved), 0);

  // The step after a resume uses the restored weights on every rank: resumed at 1 rank and at 2
  // ranks, one more step lands within rounding of each other (different reduction orders).
  one.train_step(share(2, 1, 0), 1e-3, 0.5);
  const Logical two_steps_on = run(2, at_four, 2, 3, "");
  const std::vector<uint8_t>& a = two_steps_on.at("master/lm_head.weight");
  const Logical one_on = logical_state(one.state());
  const std::vector<uint8_t>& b = one_on.at("master/lm_head.weight");
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size() / 4; ++i) {
    float x, y;
    std::memcpy(&x, a.data() + 4 * i, 4);
    std::memcpy(&y, b.data() + 4 * i, 4);
    diff += (static_cast<double>(x) - y) * (static_cast<double>(x) - y);
    norm += static_cast<double>(y) * y;
  }
  std::printf("  one step after the resume, lm_head master at 2 ranks vs 1 rank: %.2e L2 relative\n",
              std::sqrt(diff / norm));
  EXPECT_LT(std::sqrt(diff / norm), 1e-5);
}

// Two expert-parallel groups of 2 (every expert block on 2 replicas): the gathered state holds each
// block once, and a 2-rank run reads it back bitwise.
TEST_F(ReshardCheckpoint, ReplicatedExpertsSaveOnceAndResumeAtTwoRanks) {
  const std::string path = (dir_ / "four_ep2.safetensors").string();
  const Logical saved = run(4, "", 0, 2, path, 2);
  const Logical at_two = run(2, path, 2, 2, "");
  EXPECT_EQ(count_different(at_two, saved), 0);
  CpuEngine initial(setup_.checkpoint, setup_.options);
  EXPECT_GT(count_different(logical_state(initial.state()), saved), 0);
}

// The per-rank files a parallel save writes (each rank its own pieces, replicas included): read at 2
// ranks and at 1 every logical tensor is bitwise the gathered state's; a set with a rank's file
// missing, or with a file of another step, is refused with a message.
TEST_F(ReshardCheckpoint, PerRankFilesResumeAtTwoAndOneBitwise) {
  for (const int ep : {4, 2}) {
    std::vector<std::string> files;
    for (int r = 0; r < 4; ++r) files.push_back((dir_ / str_cat("ep", ep, "_r", r, ".safetensors")).string());
    Logical saved;
    run_thread_comm(4, [&](Communicator& comm) {
      CpuEngine engine(setup_.checkpoint, setup_.options, &comm, layout(4, ep));
      for (int step = 0; step < 2; ++step) engine.train_step(share(step, 4, comm.rank()), 1e-3, 0.5);
      save_optimizer_state(files[comm.rank()], engine.state(), OptimizerProgress{2, 0});
      std::unique_ptr<HostTrainState> gathered = gather_train_state(comm, engine.state(), engine.full_layout());
      if (comm.rank() == 0) saved = logical_state(*gathered);
    });
    Logical at_two;
    run_thread_comm(2, [&](Communicator& comm) {
      CpuEngine engine(setup_.checkpoint, setup_.options, &comm, layout(2, 0));
      EXPECT_EQ(load_optimizer_state_files(files, &engine.state(), &engine.full_layout()).schedule_step, 2);
      std::unique_ptr<HostTrainState> gathered = gather_train_state(comm, engine.state(), engine.full_layout());
      if (comm.rank() == 0) at_two = logical_state(*gathered);
    });
    CpuEngine one(setup_.checkpoint, setup_.options);
    load_optimizer_state_files(files, &one.state());
    const int64_t differ_two = count_different(at_two, saved), differ_one = count_different(logical_state(one.state()), saved);
    std::printf("  EP %d of 4, per-rank files: read at 2 ranks %lld, at 1 rank %lld of %zu tensors differ\n", ep,
                static_cast<long long>(differ_two), static_cast<long long>(differ_one), saved.size());
    EXPECT_EQ(differ_two, 0);
    EXPECT_EQ(differ_one, 0);

    CpuEngine refused(setup_.checkpoint, setup_.options);
    try {
      load_optimizer_state_files({files[0], files[2], files[3]}, &refused.state());
      ADD_FAILURE() << "a set without rank 1's file was accepted";
    } catch (const std::exception& error) {
      EXPECT_NE(std::string(error.what()).find("hold no state for elements"), std::string::npos) << error.what();
    }
  }
  // A file of another save (step 3) among step-2 files.
  const std::string other = (dir_ / "other_step.safetensors").string();
  CpuEngine plain(setup_.checkpoint, setup_.options);
  save_optimizer_state(other, plain.state(), OptimizerProgress{3, 3});  // 3 skipped steps: adam_step 0
  try {
    load_optimizer_state_files({(dir_ / "ep4_r0.safetensors").string(), other}, &plain.state());
    ADD_FAILURE() << "files of two saves were accepted";
  } catch (const std::exception& error) {
    EXPECT_NE(std::string(error.what()).find("the files come from different saves"), std::string::npos) << error.what();
  }
}

TEST_F(ReshardCheckpoint, TwoRanksSavedAndResumedEqualTheUninterruptedRun) {
  const std::string at_four = (dir_ / "four.safetensors").string();
  const std::string at_two = (dir_ / "two.safetensors").string();
  run(4, "", 0, 1, at_four);
  const Logical uninterrupted = run(2, at_four, 1, 3, "");
  run(2, at_four, 1, 2, at_two);
  const Logical resumed = run(2, at_two, 2, 3, "");
  const int64_t differ = count_different(resumed, uninterrupted);
  std::printf("  2 ranks, steps 2-3 uninterrupted vs saved after step 2 and resumed: %lld of %zu tensors differ\n",
              static_cast<long long>(differ), resumed.size());
  EXPECT_EQ(differ, 0);
}

}  // namespace
}  // namespace deltamoe
