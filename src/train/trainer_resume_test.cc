// Exact resume and crash-safe saves: 20 steps straight equal 10 + --resume + 10 bit for bit
// (weights, master weights, Adam moments, counters), and a process killed in the middle of a save
// leaves the previous checkpoint loadable and resumable.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "core/fs_sync.h"
#include "optim/optimizer_state.h"
#include "train/train_checkpoint.h"
#include "train/train_test_util.h"
#include "train/trainer.h"

namespace deltamoe {
namespace {

using namespace train_test;

class TrainerResumeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fresh_temp_dir("trainer_resume"));
    make_tiny_vl_fixture(*root_, 48, 8);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }
  static fs::path* root_;
};
fs::path* TrainerResumeTest::root_ = nullptr;

// Names of the regular files directly in `dir`, sorted.
std::vector<std::string> file_names(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// trainer_state.json without its wall-clock field, the one thing two equal runs may differ in.
nlohmann::json trainer_state_without_time(const fs::path& dir) {
  nlohmann::json json = nlohmann::json::parse(read_bytes(dir / "trainer_state.json"));
  EXPECT_TRUE(json.contains("elapsed_s")) << dir;
  json.erase("elapsed_s");
  return json;
}

// The two checkpoint directories hold the same files (neither has one the other lacks), each
// byte-identical (model shards, index, config, tokenizer, optimizer state with its checksums)
// except trainer_state.json, which must be equal but for elapsed_s (global step, tokens seen, data
// and rng positions).
void expect_same_checkpoint(const fs::path& a, const fs::path& b) {
  const std::vector<std::string> names = file_names(a);
  ASSERT_EQ(names, file_names(b)) << a << " and " << b << " hold different files";
  size_t num_files = 0;
  for (const std::string& name : names) {
    if (name == "trainer_state.json") continue;  // holds elapsed time; compared below
    EXPECT_TRUE(read_bytes(a / name) == read_bytes(b / name)) << name << " differs";
    ++num_files;
  }
  EXPECT_EQ(trainer_state_without_time(a), trainer_state_without_time(b)) << "trainer_state.json differs";
  const TrainerState state_a = load_trainer_state(a.string()), state_b = load_trainer_state(b.string());
  EXPECT_EQ(state_a.global_step, state_b.global_step);
  EXPECT_EQ(state_a.tokens_seen, state_b.tokens_seen);
  EXPECT_EQ(state_a.data_position, state_b.data_position);
  EXPECT_EQ(state_a.rng_position, state_b.rng_position);
  std::printf("  %zu files in both, %zu compared bit for bit, trainer_state.json but for elapsed_s\n",
              names.size(), num_files);
  EXPECT_GE(num_files, 4u);
}

// The "train" lines of a metrics file have steps 1, 2, ..., num_steps once each (a resumed run
// replaces what the interrupted one wrote after its checkpoint).
void expect_metrics_steps(const fs::path& metrics, int64_t num_steps) {
  std::ifstream in(metrics);
  std::string line;
  int64_t expected = 1;
  while (std::getline(in, line)) {
    const auto json = nlohmann::json::parse(line);
    if (json.at("type") != "train") continue;
    EXPECT_EQ(json.at("step").get<int64_t>(), expected) << metrics;
    ++expected;
  }
  EXPECT_EQ(expected, num_steps + 1) << metrics;
}

TEST_F(TrainerResumeTest, TwentyStepsEqualTenPlusResumePlusTen) {
  TrainOptions straight = small_run_options(*root_);
  straight.max_steps = 20;
  straight.output_dir = (*root_ / "straight").string();
  const TrainSummary full = run_training(straight, "cpu");
  EXPECT_EQ(full.steps_done, 20);

  TrainOptions first_half = straight;
  first_half.output_dir = (*root_ / "split").string();
  first_half.stop_after_steps = 10;
  const TrainSummary part1 = run_training(first_half, "cpu");
  EXPECT_EQ(part1.steps_done, 10);
  TrainOptions second_half = first_half;
  second_half.stop_after_steps = 0;
  second_half.resume = "auto";
  const TrainSummary part2 = run_training(second_half, "cpu");
  EXPECT_EQ(part2.steps_done, 20);
  EXPECT_EQ(part2.steps_this_run, 10);

  expect_same_checkpoint(*root_ / "straight" / "checkpoint-20", *root_ / "split" / "checkpoint-20");
  expect_metrics_steps(*root_ / "split" / "metrics.jsonl", 20);
  // The training loss moved (the comparison is not between two untrained models).
  std::printf("  loss %.4f -> %.4f\n", full.first_loss, full.last_loss);
  EXPECT_LT(full.last_loss, full.first_loss);
}

TEST_F(TrainerResumeTest, KilledSaveLeavesPreviousCheckpointLoadable) {
  ASSERT_TRUE(deltamoe_binary_set());
  const std::string binary = deltamoe_binary();
  const fs::path out = *root_ / "killed";
  const std::string command =
      str_cat("DELTAMOE_FAIL_SAVE_AT_STEP=4 ", binary, " train --model ", (*root_ / "tiny-vl").string(),
              " --dataset ", (*root_ / "data" / "train.jsonl").string(), " --output_dir ", out.string(),
              " --max_steps 6 --save_steps 2 --lr 1e-3 --max_length 128 --micro_batch_tokens 256",
              " --min_pixels 4096 --max_pixels 4096 --dataloader_num_workers 1 --seed 7 > ", (*root_ / "killed.log").string(),
              " 2>&1");
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 86) << "the injected failure did not end the process; log: "
                                      << read_bytes(*root_ / "killed.log");
  EXPECT_FALSE(fs::exists(out / "checkpoint-4")) << "a half-written save appeared under its final name";
  EXPECT_TRUE(fs::exists(out / ".checkpoint-4.tmp")) << "the save did not get as far as the model files";
  ASSERT_TRUE(fs::exists(out / "checkpoint-2"));

  // The previous checkpoint loads completely: model, trainer state, optimizer state (checksums).
  const ModelCheckpoint model = load_model_dir((out / "checkpoint-2").string());
  EXPECT_TRUE(fs::exists(out / "checkpoint-2" / "tokenizer.json"));
  const TrainerState state = load_trainer_state((out / "checkpoint-2").string());
  EXPECT_EQ(state.global_step, 2);
  EXPECT_EQ(resolve_resume_dir("auto", out.string()), (out / "checkpoint-2").string());

  // And the run continues from it to the end.
  TrainOptions resume = small_run_options(*root_);
  resume.gradient_accumulation_steps = 1;
  resume.schedule = {};
  resume.schedule.lr = 1e-3;
  resume.max_steps = 6;
  resume.save_steps = 2;
  resume.output_dir = out.string();
  resume.freeze = FreezeOptions{};
  resume.resume = "auto";
  const TrainSummary summary = run_training(resume, "cpu");
  EXPECT_EQ(summary.steps_done, 6);
  EXPECT_EQ(summary.steps_this_run, 4);
  EXPECT_TRUE(fs::exists(out / "checkpoint-6" / "optimizer.safetensors"));
  EXPECT_FALSE(fs::exists(out / ".checkpoint-4.tmp")) << "the leftover temporary save was not cleaned up";
  expect_metrics_steps(out / "metrics.jsonl", 6);
}

// Options of the binary runs below as a TrainOptions (the in-process resume must match them).
TrainOptions binary_run_options(const fs::path& root, const fs::path& out) {
  TrainOptions options = small_run_options(root);
  options.gradient_accumulation_steps = 1;
  options.schedule = {};
  options.schedule.lr = 1e-3;
  options.max_steps = 6;
  options.save_steps = 2;
  options.freeze = FreezeOptions{};
  options.output_dir = out.string();
  return options;
}

// `env deltamoe train` with the flags of binary_run_options; returns the wait status.
int run_binary(const fs::path& root, const fs::path& out, const std::string& env, const std::string& extra,
               const fs::path& log) {
  EXPECT_TRUE(deltamoe_binary_set());
  const std::string binary = deltamoe_binary();
  return std::system(str_cat(env, " ", binary, " train --model ", (root / "tiny-vl").string(), " --dataset ",
                             (root / "data" / "train.jsonl").string(), " --output_dir ", out.string(),
                             " --max_steps 6 --save_steps 2 --lr 1e-3 --max_length 128 --micro_batch_tokens 256",
                             " --min_pixels 4096 --max_pixels 4096 --dataloader_num_workers 1 --seed 7 ", extra, " > ",
                             log.string(), " 2>&1")
                         .c_str());
}

bool killed_by_sigkill(int status) {
  return (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) || (WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGKILL);
}

// Names in out that an interrupted save or removal left behind.
std::vector<std::string> leftovers(const fs::path& out) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(out)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with(".checkpoint-") || name.ends_with(".tmp")) names.push_back(name);
  }
  return names;
}

// kill -9 at every phase of a save (in the middle of the model file, after the model and side
// files, in the middle of the optimizer state, after it, after trainer_state.json and the fsyncs
// before the rename, between the rename and the folder's fsync, after both, before the old copy of
// the same step is deleted, in the middle of --save_total_limit's removal) and at every phase of
// the resume-time metrics rewrite: --resume auto then finishes the run bit for bit like an
// uninterrupted one, with every metrics step once and no checkpoint or file lost.
TEST_F(TrainerResumeTest, KillMinusNineAtEveryPhaseThenResumeIsBitExact) {
  const fs::path reference = *root_ / "kill_reference";
  ASSERT_EQ(run_training(binary_run_options(*root_, reference), "cpu").steps_done, 6);
  struct Phase {
    std::string name;
    std::string env;    // of the run that is killed
    std::string extra;  // its extra flags
  };
  // #2: the second call of a point that knows no step, in the save of step 4 (one model file and
  // one optimizer file per save).
  const std::vector<Phase> phases = {
      {"safetensors_partial", "DELTAMOE_KILL_AT=safetensors_partial#2", ""},
      {"save_model", "DELTAMOE_KILL_AT=save_model@4", ""},
      {"optimizer_partial", "DELTAMOE_KILL_AT=optimizer_partial#2", ""},
      {"save_optimizer", "DELTAMOE_KILL_AT=save_optimizer@4", ""},
      {"save_state", "DELTAMOE_KILL_AT=save_state@4", ""},
      {"save_renamed_unsynced", "DELTAMOE_KILL_AT=save_renamed_unsynced@4", ""},
      {"save_renamed", "DELTAMOE_KILL_AT=save_renamed@4", ""},
      {"save_total_limit", "DELTAMOE_KILL_AT=save_total_limit@2", "--save_total_limit 1"},
  };
  const std::set<std::string> before_rename = {"safetensors_partial", "save_model", "optimizer_partial",
                                               "save_optimizer", "save_state"};
  for (const Phase& phase : phases) {
    SCOPED_TRACE(phase.name);
    const fs::path out = *root_ / ("kill_" + phase.name);
    const fs::path log = *root_ / ("kill_" + phase.name + ".log");
    ASSERT_TRUE(killed_by_sigkill(run_binary(*root_, out, phase.env, phase.extra, log))) << read_bytes(log);
    if (before_rename.contains(phase.name)) {  // the kill hit the save of step 4, before its rename
      EXPECT_TRUE(fs::exists(out / ".checkpoint-4.tmp"));
      EXPECT_FALSE(fs::exists(out / "checkpoint-4"));
    } else if (phase.name != "save_total_limit") {
      EXPECT_TRUE(fs::exists(out / "checkpoint-4"));
    }
    TrainOptions resume = binary_run_options(*root_, out);
    resume.resume = "auto";
    if (phase.name == "save_total_limit") resume.save_total_limit = 1;
    EXPECT_EQ(run_training(resume, "cpu").steps_done, 6);
    expect_same_checkpoint(reference / "checkpoint-6", out / "checkpoint-6");
    expect_metrics_steps(out / "metrics.jsonl", 6);
    EXPECT_EQ(leftovers(out), std::vector<std::string>{}) << "a leftover of the interrupted save";
    if (phase.name != "save_total_limit") {
      for (const char* kept : {"checkpoint-2", "checkpoint-4"}) EXPECT_TRUE(fs::exists(out / kept)) << kept;
    }
  }

  // Killed between moving a same-step checkpoint aside and renaming its replacement into place
  // (a run resumed from an older checkpoint saves step 4 again): the old copy is restored.
  {
    const fs::path out = *root_ / "kill_save_aside";
    const fs::path log = *root_ / "kill_save_aside.log";
    ASSERT_EQ(run_binary(*root_, out, "", "--stop_after_steps 4", log), 0) << read_bytes(log);
    ASSERT_TRUE(killed_by_sigkill(run_binary(*root_, out, "DELTAMOE_KILL_AT=save_aside@4",
                                             str_cat("--resume ", (out / "checkpoint-2").string()), log)))
        << read_bytes(log);
    ASSERT_FALSE(fs::exists(out / "checkpoint-4"));
    ASSERT_TRUE(fs::exists(out / ".checkpoint-4.old"));
    TrainOptions resume = binary_run_options(*root_, out);
    resume.resume = "auto";
    const TrainSummary summary = run_training(resume, "cpu");
    EXPECT_EQ(summary.steps_this_run, 2) << "resumed from the restored checkpoint-4";
    expect_same_checkpoint(reference / "checkpoint-6", out / "checkpoint-6");
    expect_metrics_steps(out / "metrics.jsonl", 6);
    EXPECT_EQ(leftovers(out), std::vector<std::string>{});
  }

  // Killed while a resumed run rewrites metrics.jsonl (the temporary file half written; written and
  // synced; renamed, before the folder's fsync): the file keeps its lines or already holds the
  // rewritten ones (before: 0 bytes), and the next resume ends bit for bit.
  for (const std::string point : {"metrics_rewrite_partial", "metrics_rewrite", "metrics_rewrite_renamed"}) {
    SCOPED_TRACE(point);
    const fs::path out = *root_ / ("kill_" + point);
    const fs::path log = *root_ / ("kill_" + point + ".log");
    const int killed_in_save = run_binary(*root_, out, "DELTAMOE_FAIL_SAVE_AT_STEP=4", "", log);
    ASSERT_TRUE(WIFEXITED(killed_in_save) && WEXITSTATUS(killed_in_save) == 86) << read_bytes(log);
    const std::string metrics_before = read_bytes(out / "metrics.jsonl");
    ASSERT_TRUE(killed_by_sigkill(run_binary(*root_, out, "DELTAMOE_KILL_AT=" + point, "--resume auto", log)))
        << read_bytes(log);
    const std::string metrics_after_kill = read_bytes(out / "metrics.jsonl");
    if (point == "metrics_rewrite_renamed") {  // the lines up to checkpoint-2's step: a prefix
      EXPECT_FALSE(metrics_after_kill.empty());
      EXPECT_TRUE(metrics_before.starts_with(metrics_after_kill)) << metrics_after_kill;
      EXPECT_LT(metrics_after_kill.size(), metrics_before.size());
    } else {
      EXPECT_EQ(metrics_after_kill, metrics_before) << "the kill damaged metrics.jsonl";
    }
    TrainOptions resume = binary_run_options(*root_, out);
    resume.resume = "auto";
    EXPECT_EQ(run_training(resume, "cpu").steps_done, 6);
    expect_same_checkpoint(reference / "checkpoint-6", out / "checkpoint-6");
    expect_metrics_steps(out / "metrics.jsonl", 6);
    EXPECT_EQ(leftovers(out), std::vector<std::string>{});
  }
}

// A damaged newest checkpoint (here a truncated optimizer state, as a full disk or a half copy
// leaves it) is skipped with a warning that says why, and the run resumes from the newest good one
// and ends bit for bit like an uninterrupted run. (Before: --resume auto picked it and failed.)
TEST_F(TrainerResumeTest, ResumeAutoFallsBackPastADamagedNewestCheckpoint) {
  const fs::path reference = *root_ / "fallback_reference";
  ASSERT_EQ(run_training(binary_run_options(*root_, reference), "cpu").steps_done, 6);
  const fs::path out = *root_ / "fallback";
  TrainOptions first = binary_run_options(*root_, out);
  first.stop_after_steps = 4;
  ASSERT_EQ(run_training(first, "cpu").steps_done, 4);
  const fs::path optimizer = out / "checkpoint-4" / "optimizer.safetensors";
  fs::resize_file(optimizer, fs::file_size(optimizer) / 2);
  EXPECT_NE(checkpoint_problem((out / "checkpoint-4").string()).find("truncated"), std::string::npos)
      << checkpoint_problem((out / "checkpoint-4").string());
  EXPECT_EQ(checkpoint_problem((out / "checkpoint-2").string()), "");

  ::testing::internal::CaptureStderr();
  EXPECT_EQ(resolve_resume_dir("auto", out.string()), (out / "checkpoint-2").string());
  const std::string warning = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warning.find("skipping " + (out / "checkpoint-4").string() + ": "), std::string::npos)
      << warning;

  TrainOptions resume = binary_run_options(*root_, out);
  resume.resume = "auto";
  const TrainSummary summary = run_training(resume, "cpu");
  EXPECT_EQ(summary.steps_this_run, 4);
  expect_same_checkpoint(reference / "checkpoint-6", out / "checkpoint-6");
  expect_same_checkpoint(reference / "checkpoint-4", out / "checkpoint-4");  // the damaged one was replaced
  expect_metrics_steps(out / "metrics.jsonl", 6);

  // Nothing usable at all: an error that says so.
  const fs::path broken = *root_ / "all_broken";
  fs::create_directories(broken / "checkpoint-3");
  std::ofstream(broken / "checkpoint-3" / "trainer_state.json") << "{";
  EXPECT_THROW(resolve_resume_dir("auto", broken.string()), Error);
}

// Every file of a checkpoint, the checkpoint folder and the output folder (the rename) are synced
// to disk by a save, so a power loss after the rename cannot leave an empty or partial checkpoint.
TEST_F(TrainerResumeTest, ASaveSyncsItsFilesAndTheRename) {
  std::vector<std::string> synced;
  set_fsync_observer([&](const std::string& path) { synced.push_back(path); });
  const fs::path out = *root_ / "synced";
  TrainOptions options = binary_run_options(*root_, out);
  options.max_steps = 1;
  run_training(options, "cpu");
  set_fsync_observer(nullptr);
  auto was_synced = [&](const fs::path& path) {
    return std::find(synced.begin(), synced.end(), path.string()) != synced.end();
  };
  const fs::path temp = out / ".checkpoint-1.tmp";
  for (const char* name : {"trainer_state.json", "optimizer.safetensors", "model.safetensors", "config.json",
                           "tokenizer.json"}) {
    EXPECT_TRUE(was_synced(temp / name)) << name;
  }
  EXPECT_TRUE(was_synced(temp)) << "the checkpoint folder";
  // The output folder after the rename, so after the checkpoint folder (the metrics rewrite at the
  // start syncs the output folder too, so "synced at all" would not tell).
  const auto checkpoint_synced = std::find(synced.rbegin(), synced.rend(), temp.string());
  ASSERT_NE(checkpoint_synced, synced.rend());
  EXPECT_NE(std::find(synced.rbegin(), checkpoint_synced, out.string()), checkpoint_synced)
      << "the output folder after the rename";
  EXPECT_TRUE(was_synced(out / "metrics.jsonl.tmp")) << "the metrics file before its rename";
}

}  // namespace
}  // namespace deltamoe
