// `deltamoe plan` through the binary: the 35B layout of the design's memory table fits 78 GiB with
// bf16 moments and full or selective recompute (the design's §1.4 fits full only: it counts the
// experts' master at 4 bytes, the engine keeps it split at 2), not without recompute, on the design's
// basis of two 4,096-token samples per micro-batch (--micro_batch_size 2; the default, up to one
// packed sample per 8 tokens, fits as well: the GDN workspace does not grow with the number of
// sequences). The expert exchange's receive capacity follows --expert_recv_headroom.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "testing/run_command.h"

namespace deltamoe {
namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

CommandResult plan(const std::string& recompute, int samples = 2) {
  return run_command(str_cat(deltamoe_binary(), " plan --nproc 8 --expert_model_parallel_size 8 ",
                             "--use_distributed_optimizer true --optimizer_state_dtype bf16 --micro_batch_size ",
                             samples, " --recompute ", recompute, " --gpu_memory_gib 78 2>&1"));
}

TEST(CmdPlan, EightyGigabytePartsFitWithRecompute) {
  const CommandResult full = plan("full");
  EXPECT_EQ(full.exit_code, 0) << full.output;
  EXPECT_TRUE(contains(full.output, "recompute full")) << full.output;
  EXPECT_TRUE(contains(full.output, "at most 2 samples")) << full.output;
  EXPECT_TRUE(contains(full.output, "fits: ")) << full.output;

  const CommandResult selective = plan("selective");
  EXPECT_EQ(selective.exit_code, 0) << selective.output;
  EXPECT_TRUE(contains(selective.output, "fits: ")) << selective.output;

  const CommandResult none = plan("none");
  EXPECT_EQ(none.exit_code, 3) << none.output;
  EXPECT_TRUE(contains(none.output, "does not fit: ")) << none.output;

  const CommandResult unknown = plan("mixers");
  EXPECT_NE(unknown.exit_code, 0) << unknown.output;
  EXPECT_TRUE(contains(unknown.output, "--recompute must be none, selective or full")) << unknown.output;
}

// Packed short samples (the default: up to 1,024 per 8,192 tokens) fit too: the GDN workspace keeps
// chunk states only between two chunks of one sequence, so it does not grow with the sample count.
TEST(CmdPlan, ManyShortSamplesFitAsTwoDo) {
  const CommandResult many = plan("full", 0);
  EXPECT_EQ(many.exit_code, 0) << many.output;
  EXPECT_TRUE(contains(many.output, "at most 1024 samples")) << many.output;
  EXPECT_TRUE(contains(many.output, "fits: ")) << many.output;
}

}  // namespace
}  // namespace deltamoe

// --expert_recv_headroom: auto grows the receive capacity into the memory the plan leaves (from
// 1.25x the mean), a number is taken as given, anything under 1 is refused naming the flag.
namespace deltamoe {
namespace {

double headroom_printed(const std::string& output) {
  const size_t at = output.find("x the mean");
  if (at == std::string::npos) return -1;
  const size_t start = output.rfind('(', at);
  return std::stod(output.substr(start + 1, at - start - 1));
}

TEST(CmdPlan, ExpertReceiveCapacity) {
  const std::string base = str_cat(deltamoe_binary(), " plan --nproc 8 --expert_model_parallel_size 8 ",
                                   "--use_distributed_optimizer true --optimizer_state_dtype bf16 ",
                                   "--micro_batch_size 2 --recompute full");
  const CommandResult minimum = run_command(base + " 2>&1");
  EXPECT_EQ(minimum.exit_code, 0) << minimum.output;
  EXPECT_NEAR(headroom_printed(minimum.output), 1.25, 1e-6) << minimum.output;
  const CommandResult grown = run_command(base + " --gpu_memory_gib 78 2>&1");
  EXPECT_EQ(grown.exit_code, 0) << grown.output;
  EXPECT_GT(headroom_printed(grown.output), 1.25) << grown.output;
  EXPECT_TRUE(contains(grown.output, "fits: ")) << grown.output;
  const CommandResult given = run_command(base + " --gpu_memory_gib 78 --expert_recv_headroom 2 2>&1");
  EXPECT_NEAR(headroom_printed(given.output), 2.0, 1e-6) << given.output;
  const CommandResult bad = run_command(base + " --expert_recv_headroom 0.5 2>&1");
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_TRUE(contains(bad.output, "--expert_recv_headroom must be auto or a number of at least 1")) << bad.output;
}

}  // namespace
}  // namespace deltamoe
