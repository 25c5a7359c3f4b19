// Runs `deltamoe parity` ($DELTAMOE_BINARY) on a small random checkpoint: the output file equals
// the in-process parity run bit for bit, and bad command lines or inputs fail with a clear message.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "checkpoint/checkpoint_test_util.h"
#include "checkpoint/model_checkpoint.h"
#include "checkpoint/random_init.h"
#include "checkpoint/safetensors.h"
#include "model/config.h"
#include "train/parity.h"

namespace deltamoe {
namespace {

struct RunResult {
  int exit_code = -1;
  std::string output;
};

RunResult run_deltamoe(const std::string& args) {
  const char* binary = std::getenv("DELTAMOE_BINARY");
  EXPECT_NE(binary, nullptr) << "DELTAMOE_BINARY is not set (run through ctest)";
  RunResult result;
  if (binary == nullptr) return result;
  const std::string command = std::string(binary) + " " + args + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.output.append(buffer.data(), n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

HostTensor int64_tensor(const std::vector<int64_t>& values, Shape shape) {
  HostTensor tensor(DType::i64, shape);
  std::memcpy(tensor.data(), values.data(), values.size() * sizeof(int64_t));
  return tensor;
}

class CmdParity : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelConfig config = model_config_preset("tiny");
    config.text.dtype = "float32";
    save_model_dir(random_init_checkpoint(config, 11, DType::f32), dir_.path("model"),
                   SaveOptions{ExpertLayout::per_expert, 0});
    std::vector<int64_t> ids(2 * 9), labels(2 * 9);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 37 + 5) % 4000), labels[i] = ids[i];
    labels[0] = labels[9] = -100;
    write_safetensors(dir_.path("inputs.safetensors"),
                      {{"input_ids", StoredTensor::from_host(int64_tensor(ids, {2, 9}))},
                       {"labels", StoredTensor::from_host(int64_tensor(labels, {2, 9}))}});
  }
  ScratchDir dir_{"cmd_parity_test"};
};

TEST_F(CmdParity, OutputEqualsInProcessRun) {
  const RunResult run = run_deltamoe(str_cat("parity --model ", dir_.path("model"), " --inputs ",
                                             dir_.path("inputs.safetensors"), " --out ", dir_.path("out.safetensors")));
  std::printf("%s", run.output.c_str());
  ASSERT_EQ(run.exit_code, 0);
  const ParityResult expected =
      run_parity_cpu(load_model_dir(dir_.path("model")), load_parity_inputs(dir_.path("inputs.safetensors")));
  const auto out = SafetensorsFile::open(dir_.path("out.safetensors"));
  EXPECT_EQ(out->tensor("ce_loss").to_host().as<float>()[0], static_cast<float>(expected.ce_loss));
  EXPECT_EQ(out->tensor("aux_loss").to_host().as<float>()[0], static_cast<float>(expected.aux_loss));
  EXPECT_TRUE(out->tensor("logits").bitwise_equal(StoredTensor::from_host(expected.logits)));
  size_t compared = 0;
  for (const auto& [kind, grads] : {std::pair{"grad.", &expected.grads}, std::pair{"grad_aux.", &expected.grads_aux}})
    for (const auto& [name, grad] : *grads) {
      ASSERT_TRUE(out->contains(kind + name)) << kind << name;
      EXPECT_TRUE(out->tensor(kind + name).bitwise_equal(StoredTensor::from_host(grad))) << kind << name;
      ++compared;
    }
  std::printf("  %zu gradient tensors identical to the in-process run\n", compared);
  EXPECT_EQ(out->entries().size(), compared + 3);
}

TEST_F(CmdParity, BadCommandLinesAndInputsFailClearly) {
  RunResult run =
      run_deltamoe(str_cat("parity --model ", dir_.path("model"), " --inputs ", dir_.path("inputs.safetensors")));
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("--out"), std::string::npos) << run.output;
  run = run_deltamoe(str_cat("parity --model ", dir_.path("model"), " --inputs ", dir_.path("missing.safetensors"),
                             " --out ", dir_.path("out.safetensors")));
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("missing.safetensors"), std::string::npos) << run.output;
  run = run_deltamoe(str_cat("parity --model ", dir_.path("model"), " --inputs ", dir_.path("inputs.safetensors"),
                             " --out ", dir_.path("out.safetensors"), " --device tpu"));
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("--device tpu"), std::string::npos) << run.output;
  std::printf("%s", run.output.c_str());
}

}  // namespace
}  // namespace deltamoe
