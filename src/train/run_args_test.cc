// args.json: every option recorded under its flag name, and the --resume comparison that refuses
// options changing what is trained (lr, batch, data, seed, ...) and lets reporting options change.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "train/run_args.h"
#include "train/run_folder.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

TEST(RunArgs, RecordsEveryOptionUnderItsFlagName) {
  TrainOptions options;
  options.schedule.lr = 2e-4;
  options.dataset_paths = {"a.jsonl#10", "b.json"};
  const nlohmann::ordered_json json = train_options_to_json(options);
  EXPECT_EQ(json["lr"], 2e-4);
  EXPECT_EQ(json["dataset"], nlohmann::ordered_json({"a.jsonl#10", "b.json"}));
  for (const char* key : {"model", "output_dir", "max_length", "global_batch_size", "seed", "freeze_vit", "template",
                          "media_dir", "max_skip_ratio", "report_to", "deltamoe_version"}) {
    EXPECT_TRUE(json.contains(key)) << key;
  }
}

TEST(RunArgs, ChangesThatBreakExactnessAreToldApart) {
  TrainOptions before;
  TrainOptions after = before;
  after.schedule.lr = before.schedule.lr * 2;
  after.logging_steps = 7;
  after.num_workers = 9;
  after.seed = 1;
  const ArgsChanges changes = compare_run_args(train_options_to_json(before), train_options_to_json(after));
  ASSERT_EQ(changes.breaking.size(), 2u);
  EXPECT_NE(changes.breaking[0].find("--lr 1e-05 -> 2e-05"), std::string::npos) << changes.breaking[0];
  EXPECT_NE(changes.breaking[1].find("--seed 42 -> 1"), std::string::npos) << changes.breaking[1];
  EXPECT_EQ(changes.harmless.size(), 2u);
  EXPECT_TRUE(compare_run_args(train_options_to_json(before), train_options_to_json(before)).breaking.empty());
}

// A run saved before --expert_grad_dtype existed trained with fp32 expert gradients: resuming it
// with the new default (bf16) is a change that breaks exactness; with f32 it is not.
TEST(RunArgs, AnOptionMissingFromAnOlderRunComparesAsItsValueThen) {
  TrainOptions options;
  nlohmann::ordered_json older = train_options_to_json(options);
  older.erase("expert_grad_dtype");
  ASSERT_EQ(options.expert_grad_dtype, DType::bf16);
  const ArgsChanges changes = compare_run_args(older, train_options_to_json(options));
  ASSERT_EQ(changes.breaking.size(), 1u);
  EXPECT_NE(changes.breaking[0].find("--expert_grad_dtype \"f32\" -> \"bf16\""), std::string::npos)
      << changes.breaking[0];
  options.expert_grad_dtype = DType::f32;
  EXPECT_TRUE(compare_run_args(older, train_options_to_json(options)).breaking.empty());
}

TEST(RunArgs, ResumeRefusesAChangedLearningRateUnlessTold) {
  const fs::path dir = fs::temp_directory_path() / ("deltamoe_args_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  TrainOptions saved;
  write_run_args(dir.string(), train_options_to_json(saved, RunArgsCopy::kCheckpoint).dump(2));
  EXPECT_TRUE(fs::exists(dir / "args.json"));
  EXPECT_FALSE(fs::exists(dir / ".args.json.tmp"));
  EXPECT_NO_THROW(check_resume_args(dir.string(), saved));
  TrainOptions changed = saved;
  changed.schedule.lr = 3e-4;
  try {
    check_resume_args(dir.string(), changed);
    ADD_FAILURE() << "a changed --lr was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("--lr 1e-05 -> 0.0003"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("--ignore_args_check"), std::string::npos) << error.what();
  }
  changed.ignore_args_check = true;
  EXPECT_NO_THROW(check_resume_args(dir.string(), changed));
  fs::remove_all(dir);
}

TEST(RunFolder, VersionsCountUpAndResumeFindsTheNewestWithACheckpoint) {
  const fs::path out = fs::temp_directory_path() / ("deltamoe_versions_" + std::to_string(::getpid()));
  fs::remove_all(out);
  const std::string first = new_version_dir(out.string());
  EXPECT_EQ(fs::path(first).filename().string().substr(0, 3), "v0-");
  fs::create_directories(fs::path(first) / "checkpoint-2");
  const std::string second = new_version_dir(out.string());
  EXPECT_EQ(fs::path(second).filename().string().substr(0, 3), "v1-");
  fs::create_directories(second);  // started, no checkpoint yet
  EXPECT_EQ(newest_version_dir_with_checkpoint(out.string()), first);
  fs::create_directories(fs::path(second) / "checkpoint-1");
  EXPECT_EQ(newest_version_dir_with_checkpoint(out.string()), second);
  fs::remove_all(out);
}

}  // namespace
}  // namespace deltamoe
