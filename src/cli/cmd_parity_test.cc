// Runs `deltamoe parity` ($DELTAMOE_BINARY) on a small random checkpoint and on the VLM golden case
// (images, --freeze_* flags): the output file equals the in-process parity run bit for bit, frozen
// parts are absent from it, and bad command lines or inputs fail with a clear message.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "checkpoint/checkpoint_test_util.h"
#include "checkpoint/model_checkpoint.h"
#include "checkpoint/random_init.h"
#include "checkpoint/safetensors.h"
#include "model/config.h"
#include "train/parity.h"
#include "testing/run_deltamoe.h"

namespace deltamoe {
namespace {

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
  const CommandResult run = run_deltamoe(str_cat("parity --model ", dir_.path("model"), " --inputs ",
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
  CommandResult run =
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

#if !DELTAMOE_WITH_CUDA
// A CPU-only build names why --device cuda cannot run, before reading the model.
TEST_F(CmdParity, CudaDeviceNeedsACudaBuild) {
  const CommandResult run = run_deltamoe(str_cat("parity --model ", dir_.path("model"), " --inputs ",
                                             dir_.path("inputs.safetensors"), " --out ", dir_.path("out.safetensors"),
                                             " --device cuda"));
  std::printf("%s", run.output.c_str());
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("built with CUDA"), std::string::npos) << run.output;
  EXPECT_FALSE(std::filesystem::exists(dir_.path("out.safetensors")));
}
#endif

// The VLM golden case through the command line: images in, vision gradients out; with
// --freeze_vit --freeze_llm only the merger's gradients are written, equal to the in-process run.
TEST_F(CmdParity, ImagesAndFreezeFlags) {
  const char* source = std::getenv("DELTAMOE_SOURCE_DIR");
  const std::string golden = str_cat(source != nullptr ? source : ".", "/tests/golden/vlm_two_images");
  const ModelCheckpoint checkpoint = load_model_dir(golden + "/model");
  const ParityInputs inputs = load_parity_inputs(golden + "/inputs.safetensors");
  ASSERT_TRUE(inputs.pixel_values.has_value()) << golden << " has no images";
  for (const bool frozen : {false, true}) {
    const CommandResult run =
        run_deltamoe(str_cat("parity --model ", golden, "/model --inputs ", golden, "/inputs.safetensors --out ",
                             dir_.path("vlm.safetensors"), frozen ? " --freeze_vit --freeze_llm" : ""));
    std::printf("%s", run.output.c_str());
    ASSERT_EQ(run.exit_code, 0);
    TrainableParts parts;
    parts.vit = parts.llm = !frozen;
    const ParityResult expected = run_parity_cpu(checkpoint, inputs, parts);
    const auto out = SafetensorsFile::open(dir_.path("vlm.safetensors"));
    size_t visual = 0, merger = 0, compared = 0;
    for (const auto& [kind, grads] : {std::pair{"grad.", &expected.grads}, std::pair{"grad_aux.", &expected.grads_aux}})
      for (const auto& [name, grad] : *grads) {
        ASSERT_TRUE(out->contains(kind + name)) << kind << name;
        EXPECT_TRUE(out->tensor(kind + name).bitwise_equal(StoredTensor::from_host(grad))) << kind << name;
        visual += name.rfind("model.visual.", 0) == 0;
        merger += name.rfind("model.visual.merger.", 0) == 0;
        ++compared;
      }
    std::printf("  %s: %zu gradient tensors (%zu vision, %zu merger), identical to the in-process run\n",
                frozen ? "--freeze_vit --freeze_llm" : "nothing frozen", compared, visual, merger);
    EXPECT_EQ(out->entries().size(), compared + 3);
    EXPECT_EQ(merger, 12u);  // 6 merger tensors, ce and aux
    if (frozen) {
      EXPECT_EQ(compared, merger);
    } else {
      EXPECT_EQ(visual, static_cast<size_t>(2 * (9 + 12 * checkpoint.config.vision.depth)));
      EXPECT_GT(compared, visual);
    }
  }
}

}  // namespace
}  // namespace deltamoe
