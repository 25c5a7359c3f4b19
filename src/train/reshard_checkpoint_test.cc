// Checkpoints across world sizes on the CPU engine: the per-rank optimizer files of a 4-rank job
// (EP 4, ZeRO-2) are read back at 2 ranks and at 1 with every logical tensor (master, exp_avg,
// exp_avg_sq) bitwise equal to what the ranks held, and a 2-rank run saved and resumed continues
// bitwise like the uninterrupted 2-rank run. The ranks are threads, so the test collects what each
// holds straight from its memory (collect_pieces), independently of the files.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>

#include "optim/optimizer_state.h"
#include "parallel/thread_comm.h"
#include "train/cpu_engine.h"
#include "train/train_checkpoint.h"
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

// Adds what `state` holds (its pieces) into `out` ("kind/name" -> the whole tensor's bytes); ranks
// that hold the same piece (expert replicas) write the same bytes. Thread safe through `mutex`.
void collect_pieces(const TrainStateStore& state, const ParamLayout& full, Logical* out, std::mutex* mutex) {
  const ParamLayout& layout = state.layout();
  std::lock_guard lock(*mutex);
  for (const StateKind kind : kStateKinds) {
    const size_t element = dtype_size(state_dtype(kind, state.adamw_config()));
    for (int i = 0; i < layout.num_tensors(); ++i) {
      const ParamEntry& entry = layout.entry(i);
      std::vector<uint8_t>& bytes = (*out)[str_cat(state_kind_name(kind), "/", entry.name)];
      bytes.resize(static_cast<size_t>(full.entry(full.find(entry.name)).numel) * element);
      state.read_state(kind, i, 0, entry.numel, bytes.data() + static_cast<size_t>(entry.tensor_begin) * element);
    }
  }
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
  // The per-rank optimizer files of a save on `world` ranks named `name`.
  std::vector<std::string> files(const std::string& name, int world) const {
    std::vector<std::string> out;
    for (int r = 0; r < world; ++r) out.push_back((dir_ / name / optimizer_rank_file(r, world)).string());
    return out;
  }
  // On `world` ranks: optionally resume from the per-rank files of save `load` (made on load_world
  // ranks), train steps [first, last), then (if `save` is set) write the per-rank files of save
  // `save`. Returns the job's logical state, collected from the ranks' memory.
  // ep: expert-parallel size (0: the world size).
  Logical run(int world, const std::string& load, int load_world, int first, int last, const std::string& save,
              int ep = 0) {
    Logical result;
    std::mutex mutex;
    if (!save.empty()) fs::create_directories(dir_ / save);
    run_thread_comm(world, [&](Communicator& comm) {
      CpuEngine engine(setup_.checkpoint, setup_.options, &comm, layout(world, ep));
      if (!load.empty()) {
        const OptimizerProgress progress =
            load_optimizer_state_files(files(load, load_world), &engine.state(), &engine.full_layout());
        EXPECT_EQ(progress.schedule_step, first);
      }
      for (int step = first; step < last; ++step) engine.train_step(share(step, world, comm.rank()), 1e-3, 0.5);
      if (!save.empty()) {
        save_optimizer_state(files(save, world)[comm.rank()], engine.state(), OptimizerProgress{last, 0});
      }
      collect_pieces(engine.state(), engine.full_layout(), &result, &mutex);
    });
    return result;
  }

  parallel_test::Setup setup_;
  fs::path dir_;
};

TEST_F(ReshardCheckpoint, SavedAtFourRanksResumesAtTwoAndOneBitwise) {
  const Logical saved = run(4, "", 0, 0, 2, "four");
  // Read back at 2 ranks (each restores only its pieces).
  const Logical at_two = run(2, "four", 4, 2, 2, "");
  // ... and at 1 rank by the plain engine.
  CpuEngine one(setup_.checkpoint, setup_.options);
  load_optimizer_state_files(files("four", 4), &one.state());
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
  const Logical two_steps_on = run(2, "four", 4, 2, 3, "");
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

// Two expert-parallel groups of 2 (every expert block on 2 replicas, each writing its file): a
// 2-rank run reads them back bitwise.
TEST_F(ReshardCheckpoint, ReplicatedExpertsResumeAtTwoRanks) {
  const Logical saved = run(4, "", 0, 0, 2, "four_ep2", 2);
  const Logical at_two = run(2, "four_ep2", 4, 2, 2, "");
  EXPECT_EQ(count_different(at_two, saved), 0);
  CpuEngine initial(setup_.checkpoint, setup_.options);
  EXPECT_GT(count_different(logical_state(initial.state()), saved), 0);
}

// The per-rank files a parallel save writes (each rank its own pieces, replicas included): read at 2
// ranks and at 1 every logical tensor is bitwise what the 4 ranks held; a set with a rank's file
// missing, or with a file of another step, is refused with a message.
TEST_F(ReshardCheckpoint, PerRankFilesResumeAtTwoAndOneBitwise) {
  for (const int ep : {4, 2}) {
    const std::string name = str_cat("ep", ep);
    const Logical saved = run(4, "", 0, 0, 2, name, ep);
    const Logical at_two = run(2, name, 4, 2, 2, "");
    CpuEngine one(setup_.checkpoint, setup_.options);
    load_optimizer_state_files(files(name, 4), &one.state());
    const int64_t differ_two = count_different(at_two, saved), differ_one = count_different(logical_state(one.state()), saved);
    std::printf("  EP %d of 4, per-rank files: read at 2 ranks %lld, at 1 rank %lld of %zu tensors differ\n", ep,
                static_cast<long long>(differ_two), static_cast<long long>(differ_one), saved.size());
    EXPECT_EQ(differ_two, 0);
    EXPECT_EQ(differ_one, 0);

    const std::vector<std::string> all = files(name, 4);
    CpuEngine refused(setup_.checkpoint, setup_.options);
    try {
      load_optimizer_state_files({all[0], all[2], all[3]}, &refused.state());
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
    load_optimizer_state_files({files("ep4", 4)[0], other}, &plain.state());
    ADD_FAILURE() << "files of two saves were accepted";
  } catch (const std::exception& error) {
    EXPECT_NE(std::string(error.what()).find("the files come from different saves"), std::string::npos) << error.what();
  }
}

TEST_F(ReshardCheckpoint, TwoRanksSavedAndResumedEqualTheUninterruptedRun) {
  run(4, "", 0, 0, 1, "four");
  const Logical uninterrupted = run(2, "four", 4, 1, 3, "");
  run(2, "four", 4, 1, 2, "two");
  const Logical resumed = run(2, "two", 2, 2, 3, "");
  const int64_t differ = count_different(resumed, uninterrupted);
  std::printf("  2 ranks, steps 2-3 uninterrupted vs saved after step 2 and resumed: %lld of %zu tensors differ\n",
              static_cast<long long>(differ), resumed.size());
  EXPECT_EQ(differ, 0);
}

}  // namespace
}  // namespace deltamoe
