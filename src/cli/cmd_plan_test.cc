// `deltamoe plan` through the binary: the 35B layout of the design's memory table prints its plan,
// and --recompute full (planned, not in any engine yet) is labelled as a projection wherever it
// speaks of fitting, while the modes a run can use are not.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "testing/run_command.h"

namespace deltamoe {
namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

CommandResult plan(const std::string& recompute) {
  return run_command(str_cat(deltamoe_binary(), " plan --nproc 8 --expert_model_parallel_size 8 ",
                             "--use_distributed_optimizer true --optimizer_state_dtype bf16 --recompute ", recompute,
                             " --gpu_memory_gib 78 2>&1"));
}

TEST(CmdPlan, FullRecomputeIsLabelledAProjection) {
  const CommandResult full = plan("full");
  EXPECT_EQ(full.exit_code, 0) << full.output;  // fits 78 GiB (design §1.4)
  EXPECT_TRUE(contains(full.output, "PROJECTION: --recompute full")) << full.output;
  EXPECT_TRUE(contains(full.output, "arrives with the GPU parallel step")) << full.output;
  EXPECT_TRUE(contains(full.output, "fits (projection: with --recompute full, which no engine has yet)"))
      << full.output;

  const CommandResult mixers = plan("mixers");
  EXPECT_EQ(mixers.exit_code, 3) << mixers.output;  // does not fit 78 GiB
  EXPECT_FALSE(contains(mixers.output, "projection")) << mixers.output;
  EXPECT_FALSE(contains(mixers.output, "PROJECTION")) << mixers.output;
  EXPECT_TRUE(contains(mixers.output, "does not fit: ")) << mixers.output;
}

}  // namespace
}  // namespace deltamoe
