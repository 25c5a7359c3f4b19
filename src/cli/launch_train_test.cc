// `deltamoe train` on several ranks through the binary:
// `deltamoe launch --nproc_per_node 2 -- train --expert_model_parallel_size 2
// --use_distributed_optimizer true` on tiny-vl for 10 steps writes the losses of the one-rank run
// with twice the accumulation (the same samples in the same order): the first step bitwise, every
// step within 1e-5 relative; the same through NPROC_PER_NODE=2 (and mpirun -np 2 where built with
// MPI). A run saved at 2 ranks resumes at 1; one saved at 4 ranks resumes at 2 and at 1. A SIGTERM
// that reaches one rank stops every rank after the same step with one checkpoint.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <thread>
#include <cmath>
#include <nlohmann/json.hpp>

#include "parallel/world.h"
#include "testing/run_command.h"
#include "train/train_checkpoint.h"
#include "train/train_test_util.h"

namespace deltamoe {
namespace {

using namespace train_test;

class LaunchTrainTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fresh_temp_dir("launch_train"));
    make_tiny_vl_fixture(*root_, 40, 4);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }
  static std::string binary() { return deltamoe_binary(); }
  // Runs `prefix` + train with the common flags; returns the exit status and keeps the log.
  static int train(const std::string& name, const std::string& prefix, const std::string& extra) {
    const fs::path out = *root_ / name;
    const std::string command =
        str_cat(prefix, " train --device cpu --model ", (*root_ / "tiny-vl").string(), " --dataset ",
                (*root_ / "data" / "train.jsonl").string(), " --output_dir ", out.string(),
                " --max_length 128 --min_pixels 4096 --max_pixels 4096 --micro_batch_tokens 192 --max_steps 10",
                " --lr 2e-3 --warmup_ratio 0.1 --freeze_vit false --freeze_aligner false --dataloader_num_workers 1",
                " --seed 3 ", extra, " > ", (*root_ / (name + ".log")).string(), " 2>&1");
    const int status = std::system(command.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  static std::vector<double> losses(const std::string& name) {
    std::vector<double> values;
    std::ifstream in(*root_ / name / "metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("loss") && !j.contains("val_loss")) values.push_back(j["loss"].get<double>());
    }
    return values;
  }
  static std::string log_of(const std::string& name) { return read_bytes(*root_ / (name + ".log")); }
  static void expect_like_one_rank(const std::string& name) {
    const std::vector<double> one = losses("one_rank"), got = losses(name);
    ASSERT_EQ(one.size(), 10u) << log_of("one_rank");
    ASSERT_EQ(got.size(), one.size()) << log_of(name);
    double worst = 0;
    for (size_t i = 0; i < one.size(); ++i) {
      const double relative = std::fabs(got[i] - one[i]) / std::fabs(one[i]);
      worst = std::max(worst, relative);
      EXPECT_LE(relative, 1e-5) << "step " << i + 1 << ": " << got[i] << " vs " << one[i];
    }
    EXPECT_EQ(got[0], one[0]) << "the first step's loss is bitwise that of one rank";
    std::printf("  %s: 10 losses, worst relative difference to one rank %.2e (first %s)\n", name.c_str(), worst,
                got[0] == one[0] ? "bitwise" : "differs");
  }
  static fs::path* root_;
};
fs::path* LaunchTrainTest::root_ = nullptr;

TEST_F(LaunchTrainTest, TwoRanksTrainLikeOneRankWithTwiceTheAccumulation) {
  ASSERT_EQ(train("one_rank", binary(), "--gradient_accumulation_steps 4"), 0) << log_of("one_rank");
  ASSERT_EQ(train("launch", str_cat(binary(), " launch --nproc_per_node 2 --"),
                  "--gradient_accumulation_steps 2 --expert_model_parallel_size 2 --use_distributed_optimizer true"),
            0)
      << log_of("launch");
  expect_like_one_rank("launch");
  // The checkpoint has the model files a single rank writes (each rank wrote its own byte ranges of
  // them; byte-identical: rank_checkpoint_test) and each rank's optimizer state in its own file.
  EXPECT_TRUE(fs::exists(*root_ / "launch" / "checkpoint-10" / optimizer_rank_file(1, 2)));
  EXPECT_TRUE(fs::exists(*root_ / "launch" / "checkpoint-10" / "model.safetensors") ||
              fs::exists(*root_ / "launch" / "checkpoint-10" / "model.safetensors.index.json"));

  ASSERT_EQ(train("nproc", "NPROC_PER_NODE=2 " + binary(),
                  "--gradient_accumulation_steps 2 --expert_model_parallel_size 2 --use_distributed_optimizer true"),
            0)
      << log_of("nproc");
  expect_like_one_rank("nproc");
  // Saved at 2 ranks after 5 steps, resumed at 1 rank (--resume auto, twice the accumulation): the
  // checkpoint holds whole tensors, the data position is global.
  const std::string two = "--gradient_accumulation_steps 2 --expert_model_parallel_size 2 --use_distributed_optimizer true";
  ASSERT_EQ(train("resumed", str_cat(binary(), " launch --nproc_per_node 2 --"), two + " --stop_after_steps 5"), 0)
      << log_of("resumed");
  ASSERT_EQ(losses("resumed").size(), 5u);
  ASSERT_EQ(train("resumed", binary(), "--gradient_accumulation_steps 4 --resume auto"), 0) << log_of("resumed");
  expect_like_one_rank("resumed");
  if (!mpi_built()) {
    std::printf("  mpirun: not checked (built without MPI)\n");
    return;
  }
  ASSERT_EQ(train("mpirun", str_cat(mpirun_prefix(2), " ", binary()),
                  "--gradient_accumulation_steps 2 --expert_model_parallel_size 2 --use_distributed_optimizer true"),
            0)
      << log_of("mpirun");
  expect_like_one_rank("mpirun");
}

// A 4-rank run whose rank 1 is killed at step 3: every rank ends non-zero within seconds with the
// message naming rank 1 and the step; --resume auto from the checkpoint of step 2 then gives the
// losses of the uninterrupted 4-rank run bitwise.
TEST_F(LaunchTrainTest, KilledRankEndsTheRunAndResumeContinuesExactly) {
  const std::string four = str_cat(binary(), " launch --nproc_per_node 4 --grace_period 3 --");
  const std::string flags =
      "--gradient_accumulation_steps 1 --expert_model_parallel_size 4 --use_distributed_optimizer true --save_steps 2";
  ASSERT_EQ(train("four", four, flags + " --max_steps 4"), 0) << log_of("four");
  const auto start = std::chrono::steady_clock::now();
  const int killed = train("killed", "DELTAMOE_COMM_TIMEOUT=10 DELTAMOE_FAULT='rank:1,at:step 3,kind:kill' " + four,
                           flags + " --max_steps 4");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string log = log_of("killed");
  EXPECT_NE(killed, 0) << log;
  EXPECT_LT(seconds, 30) << log;
  EXPECT_NE(log.find("label 'step 3'"), std::string::npos) << log;
  EXPECT_NE(log.find("the job failed because of rank 1, which was killed by signal 9"), std::string::npos) << log;
  for (int r : {0, 2, 3}) EXPECT_NE(log.find(str_cat("rank ", r, ": job aborted: ")), std::string::npos) << log;
  ASSERT_TRUE(fs::exists(*root_ / "killed" / "checkpoint-2")) << log;
  EXPECT_FALSE(fs::exists(*root_ / "killed" / "checkpoint-4"));
  ASSERT_EQ(train("killed", four, flags + " --max_steps 4 --resume auto"), 0) << log_of("killed");
  const std::vector<double> want = losses("four"), got = losses("killed");
  ASSERT_EQ(want.size(), 4u);
  EXPECT_EQ(got, want) << "the resumed run's losses equal the uninterrupted run's bitwise";
  std::printf("  killed at step 3 after %.1f s; resumed: %zu losses, %s\n", seconds, got.size(),
              got == want ? "bitwise those of the uninterrupted run" : "DIFFERENT");

  // A rank that stops answering at step 3: the deadline (2 s here) aborts the job naming it.
  const auto hang_start = std::chrono::steady_clock::now();
  const int hung = train("hung", "DELTAMOE_COMM_TIMEOUT=2 DELTAMOE_FAULT='rank:1,at:step 3,kind:hang' " + four,
                         flags + " --max_steps 4");
  const double hang_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - hang_start).count();
  const std::string hang_log = log_of("hung");
  EXPECT_NE(hung, 0) << hang_log;
  EXPECT_LT(hang_seconds, 30) << hang_log;
  EXPECT_NE(hang_log.find("held up by rank 1 (pid "), std::string::npos) << hang_log;
  EXPECT_NE(hang_log.find("label 'step 3'"), std::string::npos) << hang_log;
  std::printf("  hanging rank at step 3: the job ended after %.1f s\n", hang_seconds);
}

// Saved at 4 ranks (EP 4) after 4 of 10 steps, resumed through `train` at 2 ranks (EP 2) and at 1:
// the data position is global and the checkpoint holds whole tensors, so both continue with the
// same samples; a 2-rank run saved again after step 7 and resumed ends bitwise like the 2-rank run
// that went through without a stop (losses and every checkpoint-10 file byte).
TEST_F(LaunchTrainTest, SavedAtFourRanksResumesAtTwoAndAtOne) {
  const std::string zero = " --use_distributed_optimizer true";
  const std::string four = str_cat(binary(), " launch --nproc_per_node 4 --"),
                    two = str_cat(binary(), " launch --nproc_per_node 2 --");
  const std::string four_flags = "--gradient_accumulation_steps 1 --expert_model_parallel_size 4" + zero,
                    two_flags = "--gradient_accumulation_steps 2 --expert_model_parallel_size 2" + zero,
                    one_flags = "--gradient_accumulation_steps 4";
  ASSERT_EQ(train("at_four", four, four_flags + " --stop_after_steps 4"), 0) << log_of("at_four");
  ASSERT_EQ(losses("at_four").size(), 4u);
  ASSERT_TRUE(fs::exists(*root_ / "at_four" / "checkpoint-4"));
  // Each rank wrote its own optimizer state; a checkpoint that lacks one of them is not resumable.
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(fs::exists(*root_ / "at_four" / "checkpoint-4" / optimizer_rank_file(r, 4))) << r;
  }
  EXPECT_FALSE(fs::exists(*root_ / "at_four" / "checkpoint-4" / "optimizer.safetensors"));
  EXPECT_EQ(checkpoint_problem((*root_ / "at_four" / "checkpoint-4").string()), "");
  fs::remove_all(*root_ / "rank_file_missing");
  fs::copy(*root_ / "at_four" / "checkpoint-4", *root_ / "rank_file_missing", fs::copy_options::recursive);
  fs::remove(*root_ / "rank_file_missing" / optimizer_rank_file(1, 4));
  EXPECT_NE(checkpoint_problem((*root_ / "rank_file_missing").string()).find("the optimizer state of rank 1 of 4"),
            std::string::npos)
      << checkpoint_problem((*root_ / "rank_file_missing").string());
  for (const char* copy : {"four_to_two", "four_to_two_stopped", "four_to_one"}) {
    fs::remove_all(*root_ / copy);
    fs::copy(*root_ / "at_four", *root_ / copy, fs::copy_options::recursive);
  }
  ASSERT_EQ(train("four_to_two", two, two_flags + " --resume auto"), 0) << log_of("four_to_two");
  ASSERT_EQ(train("four_to_two_stopped", two, two_flags + " --resume auto --stop_after_steps 3"), 0)
      << log_of("four_to_two_stopped");
  ASSERT_TRUE(fs::exists(*root_ / "four_to_two_stopped" / "checkpoint-7"));
  ASSERT_EQ(train("four_to_two_stopped", two, two_flags + " --resume auto"), 0) << log_of("four_to_two_stopped");
  ASSERT_EQ(train("four_to_one", binary(), one_flags + " --resume auto"), 0) << log_of("four_to_one");

  const std::vector<double> at_two = losses("four_to_two"), stopped = losses("four_to_two_stopped"),
                            at_one = losses("four_to_one"), before = losses("at_four");
  ASSERT_EQ(at_two.size(), 10u) << log_of("four_to_two");
  ASSERT_EQ(at_one.size(), 10u) << log_of("four_to_one");
  EXPECT_EQ(stopped, at_two) << "saved and resumed again at 2 ranks: the losses of the 2-rank run without a stop";
  for (const std::string& file : {optimizer_rank_file(0, 2), optimizer_rank_file(1, 2), std::string("model.safetensors")}) {
    EXPECT_EQ(read_bytes(*root_ / "four_to_two_stopped" / "checkpoint-10" / file),
              read_bytes(*root_ / "four_to_two" / "checkpoint-10" / file))
        << file << " of the 2-rank runs with and without the stop after step 7";
  }
  double worst = 0;
  for (size_t i = 0; i < at_two.size(); ++i) {
    if (i < before.size()) {
      EXPECT_EQ(at_two[i], before[i]);
      EXPECT_EQ(at_one[i], before[i]);
    }
    const double relative = std::fabs(at_one[i] - at_two[i]) / std::fabs(at_two[i]);
    worst = std::max(worst, relative);
    EXPECT_LE(relative, 1e-5) << "step " << i + 1 << ": 1 rank " << at_one[i] << ", 2 ranks " << at_two[i];
  }
  // The first step after the resume sums the same gradients in another order at 1 and 2 ranks, so
  // only its start is shared; the runs must not have diverged.
  std::printf("  saved at 4 ranks after step 4; resumed at 2 and at 1: worst relative loss difference %.2e; "
              "2 ranks stopped after step 7 and resumed: %s\n",
              worst, stopped == at_two ? "bitwise the run without the stop" : "DIFFERENT");
}

// A SIGTERM that reaches rank 2 alone (a preemption notice for one process) during step 3 of 4: every
// rank stops after step 3, one checkpoint-3 is saved, every rank exits with 128 + 15, and --resume
// auto then gives the losses of the uninterrupted run bitwise.
TEST_F(LaunchTrainTest, SigtermToOneRankStopsEveryRankAtTheSameStep) {
  const std::string four = str_cat(binary(), " launch --nproc_per_node 4 --grace_period 3 --");
  const std::string flags = "--gradient_accumulation_steps 1 --expert_model_parallel_size 4 "
                            "--use_distributed_optimizer true --save_steps 2 --max_steps 4";
  ASSERT_EQ(train("uninterrupted", four, flags), 0) << log_of("uninterrupted");
  const auto start = std::chrono::steady_clock::now();
  const int status = train("termed", "DELTAMOE_FAULT='rank:2,at:step 3,kind:term' " + four, flags);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string log = log_of("termed");
  EXPECT_EQ(status, 128 + 15) << log;
  EXPECT_NE(log.find("fault injection (DELTAMOE_FAULT): rank 2 term"), std::string::npos) << log;
  for (int r = 0; r < 4; ++r) EXPECT_NE(log.find(str_cat("rank ", r, " exited with code 143")), std::string::npos) << log;
  EXPECT_NE(log.find("stopped by signal 15 (received by another rank) after step 3"), std::string::npos) << log;
  EXPECT_NE(log.find("stopped by signal 15 after step 3"), std::string::npos) << log;
  EXPECT_EQ(log.find("job aborted"), std::string::npos) << log;
  EXPECT_TRUE(fs::exists(*root_ / "termed" / "checkpoint-3")) << log;
  EXPECT_FALSE(fs::exists(*root_ / "termed" / "checkpoint-4")) << log;
  EXPECT_EQ(losses("termed").size(), 3u) << log;
  ASSERT_EQ(train("termed", four, flags + " --resume auto"), 0) << log_of("termed");
  const std::vector<double> want = losses("uninterrupted"), got = losses("termed");
  ASSERT_EQ(want.size(), 4u);
  EXPECT_EQ(got, want) << "the resumed run's losses equal the uninterrupted run's bitwise";
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(read_bytes(*root_ / "termed" / "checkpoint-4" / optimizer_rank_file(r, 4)),
              read_bytes(*root_ / "uninterrupted" / "checkpoint-4" / optimizer_rank_file(r, 4)));
  }
  std::printf("  SIGTERM to rank 2 in step 3: the job ended with code %d after %.1f s; resumed: %s\n", status, seconds,
              got == want ? "bitwise the uninterrupted run" : "DIFFERENT");

  // Rank 1 dies in the save of step 4 after writing its optimizer file, before the commit vote: the
  // job fails, nothing is renamed into place, and --resume auto continues from checkpoint-2 (the
  // half-written folder is removed) to the uninterrupted run's losses.
  const int killed = train("killed_in_save", "DELTAMOE_COMM_TIMEOUT=10 DELTAMOE_FAULT='rank:1,at:save vote at step 4,kind:kill' " + four,
                           flags);
  const std::string kill_log = log_of("killed_in_save");
  EXPECT_NE(killed, 0) << kill_log;
  EXPECT_NE(kill_log.find("the job failed because of rank 1, which was killed by signal 9"), std::string::npos)
      << kill_log;
  EXPECT_NE(kill_log.find("rank 1 kill at label 'save vote at step 4'"), std::string::npos) << kill_log;
  EXPECT_FALSE(fs::exists(*root_ / "killed_in_save" / "checkpoint-4")) << kill_log;
  ASSERT_EQ(train("killed_in_save", four, flags + " --resume auto"), 0) << log_of("killed_in_save");
  EXPECT_NE(log_of("killed_in_save").find("resuming from " + (*root_ / "killed_in_save" / "checkpoint-2").string()),
            std::string::npos)
      << log_of("killed_in_save");
  EXPECT_EQ(losses("killed_in_save"), want);
  for (const std::string& file : {optimizer_rank_file(3, 4), std::string("model.safetensors")}) {
    EXPECT_EQ(read_bytes(*root_ / "killed_in_save" / "checkpoint-4" / file),
              read_bytes(*root_ / "uninterrupted" / "checkpoint-4" / file))
        << file;
  }

  // kill -9 of every rank right after it wrote and synced its byte ranges of the model files (its
  // optimizer file not yet written): nothing is committed, --resume auto continues from
  // checkpoint-2 to the uninterrupted run's losses and model file.
  const int all_killed = train("killed_after_model_bytes", "DELTAMOE_KILL_AT=save_rank_files@4 " + four, flags);
  EXPECT_NE(all_killed, 0) << log_of("killed_after_model_bytes");
  EXPECT_FALSE(fs::exists(*root_ / "killed_after_model_bytes" / "checkpoint-4")) << log_of("killed_after_model_bytes");
  ASSERT_EQ(train("killed_after_model_bytes", four, flags + " --resume auto"), 0) << log_of("killed_after_model_bytes");
  EXPECT_EQ(losses("killed_after_model_bytes"), want);
  EXPECT_EQ(read_bytes(*root_ / "killed_after_model_bytes" / "checkpoint-4" / "model.safetensors"),
            read_bytes(*root_ / "uninterrupted" / "checkpoint-4" / "model.safetensors"));
}

// SIGTERM to the launcher (a scheduler stopping the job) once step 1 is logged: it forwards the
// signal to every rank, they agree on one step, save one checkpoint and the launcher exits 143;
// --resume auto then finishes the run.
TEST_F(LaunchTrainTest, SigtermToTheLauncherStopsTheJobWithOneCheckpoint) {
  const fs::path pid_file = *root_ / "launcher.pid";
  fs::remove(pid_file);
  const std::string flags = "--gradient_accumulation_steps 1 --expert_model_parallel_size 2 "
                            "--use_distributed_optimizer true --save_steps 100 --max_steps 10";
  int status = -1;
  std::thread job([&] {
    // sh starts the launcher in the background and writes its pid, then waits for it.
    status = train("launcher_termed",
                   str_cat("sh -c '", binary(), " launch --nproc_per_node 2 -- \"$@\" & echo $! > ",
                           pid_file.string(), "; wait $!' sh"),
                   flags);
  });
  const auto start = std::chrono::steady_clock::now();
  pid_t launcher = 0;
  while (std::chrono::steady_clock::now() - start < std::chrono::seconds(60)) {
    if (launcher == 0 && fs::exists(pid_file)) {
      std::ifstream(pid_file) >> launcher;
    }
    // A whole first line of metrics.jsonl (not parsed: the writer may be mid-line).
    if (launcher > 0 && fs::exists(*root_ / "launcher_termed" / "metrics.jsonl") &&
        read_bytes(*root_ / "launcher_termed" / "metrics.jsonl").find('\n') != std::string::npos) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GT(launcher, 0);
  ::kill(launcher, SIGTERM);
  job.join();
  const std::string log = log_of("launcher_termed");
  EXPECT_EQ(status, 128 + 15) << log;
  EXPECT_NE(log.find("launch: every rank stopped on signal 15"), std::string::npos) << log;
  std::vector<std::string> checkpoints;
  for (const auto& entry : fs::directory_iterator(*root_ / "launcher_termed")) {
    if (entry.path().filename().string().starts_with("checkpoint-")) checkpoints.push_back(entry.path().filename());
  }
  ASSERT_EQ(checkpoints.size(), 1u) << log;
  const size_t stopped_at = losses("launcher_termed").size();
  EXPECT_EQ(checkpoints[0], str_cat("checkpoint-", stopped_at)) << log;
  EXPECT_LT(stopped_at, 10u) << log;
  ASSERT_EQ(train("launcher_termed", str_cat(binary(), " launch --nproc_per_node 2 --"), flags + " --resume auto"), 0)
      << log_of("launcher_termed");
  EXPECT_EQ(losses("launcher_termed").size(), 10u);
  std::printf("  SIGTERM to the launcher after step 1 logged: stopped with code %d at %s, resumed to step 10\n", status,
              checkpoints[0].c_str());
}

TEST_F(LaunchTrainTest, BadLayoutsAreRefusedWithTheFlag) {
  EXPECT_NE(train("refused_ep", binary(), "--expert_model_parallel_size 2"), 0);
  EXPECT_NE(log_of("refused_ep").find("--expert_model_parallel_size 2 needs as many ranks"), std::string::npos)
      << log_of("refused_ep");
  EXPECT_NE(train("refused_zero", str_cat(binary(), " launch --nproc_per_node 2 --"), ""), 0);
  EXPECT_NE(log_of("refused_zero").find("needs --use_distributed_optimizer true"), std::string::npos)
      << log_of("refused_zero");
}

}  // namespace
}  // namespace deltamoe
