// End-to-end tests of 'deltamoe init / inspect / convert' through the built binary
// ($DELTAMOE_BINARY): the 35B parameter counts, completeness checks with exit codes, and a
// layout/shard conversion that round-trips to byte-identical files.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "checkpoint/checkpoint_test_util.h"
#include "checkpoint/model_checkpoint.h"
#include "checkpoint/random_init.h"
#include "checkpoint/sharded.h"
#include "model/param_table.h"
#include "testing/run_deltamoe.h"

namespace deltamoe {
namespace {

std::string with_commas(int64_t value) {
  std::string digits = std::to_string(value), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

TEST(CheckpointCli, InspectReports35BParameterCounts) {
  CommandResult result = run_deltamoe("inspect --config qwen3.5-35b-a3b");
  std::printf("%s", result.output.c_str());
  EXPECT_EQ(result.exit_code, 0);
  // Summed from the released checkpoint's tensor shapes: 35,107,181,936 parameters without mtp.*.
  EXPECT_NE(result.output.find("35,107,181,936"), std::string::npos);
  ParamCounts counts = count_params(model_config_preset("qwen3.5-35b-a3b"));
  EXPECT_NE(result.output.find("active/token"), std::string::npos);
  EXPECT_NE(result.output.find(with_commas(counts.active_per_token)), std::string::npos)
      << "expected active count " << with_commas(counts.active_per_token);
}

TEST(CheckpointCli, InitInspectConvertRoundTrip) {
  ScratchDir dir("cli");
  CommandResult init = run_deltamoe("init --config tiny-vl --out " + dir.path("a") + " --seed 3 --shard_size 0");
  ASSERT_EQ(init.exit_code, 0) << init.output;
  EXPECT_TRUE(std::filesystem::exists(dir.path("a/preprocessor_config.json")));
  CommandResult inspect = run_deltamoe("inspect " + dir.path("a") + " --tensors");
  EXPECT_EQ(inspect.exit_code, 0) << inspect.output;
  EXPECT_NE(inspect.output.find("complete"), std::string::npos) << inspect.output;
  EXPECT_NE(inspect.output.find("model.language_model.layers.0.linear_attn.A_log"), std::string::npos);

  CommandResult to_per_expert = run_deltamoe("convert --in " + dir.path("a") + " --out " + dir.path("b") +
                                         " --layout per_expert --shard_size 400000");
  ASSERT_EQ(to_per_expert.exit_code, 0) << to_per_expert.output;
  EXPECT_TRUE(std::filesystem::exists(dir.path(std::string("b/") + kWeightsIndexFile)));
  EXPECT_TRUE(std::filesystem::exists(dir.path("b/preprocessor_config.json"))) << "side files are copied";
  CommandResult inspect_b = run_deltamoe("inspect " + dir.path("b"));
  EXPECT_EQ(inspect_b.exit_code, 0) << inspect_b.output;
  EXPECT_NE(inspect_b.output.find("experts stored per_expert"), std::string::npos) << inspect_b.output;

  CommandResult back =
      run_deltamoe("convert --in " + dir.path("b") + " --out " + dir.path("c") + " --layout fused --shard_size 0");
  ASSERT_EQ(back.exit_code, 0) << back.output;
  for (const char* name : {"model.safetensors", "config.json", "preprocessor_config.json"}) {
    bool same =
        read_file_bytes(dir.path(std::string("a/") + name)) == read_file_bytes(dir.path(std::string("c/") + name));
    std::printf("%s after fused -> per_expert sharded -> fused: %s\n", name, same ? "byte-identical" : "DIFFERENT");
    EXPECT_TRUE(same) << name;
  }
}

TEST(CheckpointCli, InspectFailsOnAnIncompleteCheckpoint) {
  ScratchDir dir("cli_incomplete");
  ASSERT_EQ(run_deltamoe("init --config tiny --out " + dir.path("a") + " --shard_size 0").exit_code, 0);
  WeightsDir weights = open_weights_dir(dir.path("a"));
  std::vector<NamedTensor> kept;
  const std::string dropped = "model.layers.3.self_attn.o_proj.weight";
  for (const auto& [name, tensor] : weights.tensors) {
    if (name != dropped) kept.push_back({name, tensor});
  }
  kept.push_back({"model.layers.3.self_attn.o_proj.bias", StoredTensor::from_host(HostTensor(DType::bf16, {64}))});
  std::filesystem::create_directories(dir.path("b"));
  write_weights_dir(dir.path("b"), kept, 0);
  std::filesystem::copy_file(dir.path("a/config.json"), dir.path("b/config.json"));
  CommandResult result = run_deltamoe("inspect " + dir.path("b"));
  std::printf("%s", result.output.c_str());
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.output.find(dropped), std::string::npos);
  EXPECT_NE(result.output.find("model.layers.3.self_attn.o_proj.bias"), std::string::npos);
  CommandResult convert = run_deltamoe("convert --in " + dir.path("b") + " --out " + dir.path("c"));
  EXPECT_NE(convert.exit_code, 0);
  EXPECT_NE(convert.output.find(dropped), std::string::npos) << convert.output;
}

// The RAM rule at a small scale: converting a ~410 MB checkpoint (two 205 MB tensors) must keep the
// converter's peak resident set far below the checkpoint size (loads map, saves stream).
TEST(CheckpointCli, ConvertKeepsResidentMemoryFarBelowCheckpointSize) {
  ScratchDir dir("cli_ram");
  ModelConfig config = model_config_preset("tiny");
  config.text.vocab_size = 400'000;
  config.text.hidden_size = 256;
  config.text.bos_token_id = config.text.eos_token_id = std::nullopt;
  ModelCheckpoint checkpoint = random_init_checkpoint(config, 1, DType::bf16);
  // Cheap deterministic bytes for the two big tensors (random normals would take most of the test);
  // the high byte of each bf16 is kept below 0x40 so that no value is NaN/Inf (loads refuse those).
  for (const char* name : {"model.embed_tokens.weight", "lm_head.weight"}) {
    const Shape shape = checkpoint.params.at(name).shape();
    checkpoint.params[name] =
        StoredTensor::from_range_producer(DType::bf16, shape, [](void* dst, size_t offset, size_t n) {
          for (size_t i = 0; i < n; ++i) {
            const size_t at = offset + i;
            static_cast<uint8_t*>(dst)[i] = static_cast<uint8_t>(at * 131 % 251) & (at % 2 == 1 ? 0x3F : 0xFF);
          }
        });
  }
  SaveOptions single;
  single.max_shard_bytes = 0;
  save_model_dir(checkpoint, dir.path("a"), single);
  const int64_t file_bytes = static_cast<int64_t>(std::filesystem::file_size(dir.path("a/model.safetensors")));
  CommandResult convert = run_deltamoe("convert --in " + dir.path("a") + " --out " + dir.path("b") +
                                   " --layout per_expert --shard_size 100000000");
  ASSERT_EQ(convert.exit_code, 0) << convert.output;
  struct rusage usage {};
  getrusage(RUSAGE_CHILDREN, &usage);
  const int64_t peak_bytes = static_cast<int64_t>(usage.ru_maxrss) * 1024;
  std::printf("checkpoint %lld MB, peak resident set of the largest child %lld MB\n",
              static_cast<long long>(file_bytes >> 20), static_cast<long long>(peak_bytes >> 20));
  EXPECT_GT(file_bytes, int64_t{350} << 20);
  EXPECT_LT(peak_bytes, file_bytes / 3);
  EXPECT_EQ(run_deltamoe("inspect " + dir.path("b")).exit_code, 0);
}

TEST(CheckpointCli, BadArgumentsGiveClearErrors) {
  CommandResult both = run_deltamoe("inspect /tmp --config tiny");
  EXPECT_NE(both.exit_code, 0);
  EXPECT_NE(both.output.find("either a checkpoint directory or --config"), std::string::npos) << both.output;
  CommandResult preset = run_deltamoe("inspect --config tinyy");
  EXPECT_NE(preset.exit_code, 0);
  EXPECT_NE(preset.output.find("'tinyy' is neither a preset"), std::string::npos) << preset.output;
  CommandResult dtype = run_deltamoe("init --config tiny --out /tmp/unused_deltamoe_dir --dtype int8");
  EXPECT_NE(dtype.exit_code, 0);
  EXPECT_NE(dtype.output.find("--dtype"), std::string::npos) << dtype.output;
  CommandResult missing = run_deltamoe("inspect /nonexistent_deltamoe_dir");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find("/nonexistent_deltamoe_dir"), std::string::npos) << missing.output;
}

}  // namespace
}  // namespace deltamoe
