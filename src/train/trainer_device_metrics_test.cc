// The trainer's side of the GPU engine's reports, without a GPU: a stand-in engine (the CPU
// reference that says it is an H200 and reports FLOPs, memory and copied bytes) must reach the
// progress line and metrics.jsonl as MFU against the GPU's default peak or --peak_tflops, and the
// limits the trainer hands an engine must be the batch plan's.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "train/cpu_engine.h"
#include "train/train_test_util.h"
#include "train/trainer.h"

namespace deltamoe {
namespace {

using namespace train_test;

constexpr double kFlopsPerToken = 1e9;
constexpr size_t kMemoryBytes = size_t{3} << 30;

// CpuEngine's numbers with a GPU's reports.
class StandInGpuEngine : public CpuEngine {
 public:
  using CpuEngine::CpuEngine;
  std::string device_name() const override { return "cuda:0"; }
  std::string accelerator_name() const override { return "NVIDIA H200"; }
  StepResult train_step(const std::vector<MicroBatch>& batches, double lr, double max_grad_norm) override {
    StepResult result = CpuEngine::train_step(batches, lr, max_grad_norm);
    result.flops = kFlopsPerToken * static_cast<double>(result.num_tokens);
    result.host_to_device_bytes = 1000 * static_cast<uint64_t>(result.num_tokens);
    result.device_to_host_bytes = 24;
    return result;
  }
  size_t peak_memory_bytes() const override { return kMemoryBytes; }
};

class TrainerDeviceMetricsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fresh_temp_dir("device_metrics"));
    make_tiny_vl_fixture(*root_, 8, 4);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }
  static fs::path* root_;
};
fs::path* TrainerDeviceMetricsTest::root_ = nullptr;

std::vector<nlohmann::json> train_lines(const fs::path& metrics) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json json = nlohmann::json::parse(line);
    if (json["type"] == "train") lines.push_back(json);
  }
  return lines;
}

TEST_F(TrainerDeviceMetricsTest, GpuEngineReportsBecomeMfuAndMemory) {
  std::vector<EngineOptions> sizings;
  const EngineMaker stand_in = [&](const ModelCheckpoint& checkpoint,
                                   const EngineOptions& engine_options) -> std::unique_ptr<TrainEngine> {
    sizings.push_back(engine_options);
    return std::make_unique<StandInGpuEngine>(checkpoint, engine_options);
  };
  for (const double peak : {0.0, 100.0}) {  // 0: the H200's 989 by name
    TrainOptions options = small_run_options(*root_);
    options.output_dir = (*root_ / str_cat("run_peak_", peak)).string();
    options.max_steps = 2;
    options.peak_tflops = peak;
    const TrainSummary summary = run_training(options, "auto", stand_in);
    EXPECT_EQ(summary.device, "cuda:0");
    const std::vector<nlohmann::json> lines = train_lines(fs::path(options.output_dir) / "metrics.jsonl");
    ASSERT_EQ(lines.size(), 2u);
    // The summary's MFU: all FLOPs of the run over all its step time.
    double flops = 0, seconds = 0;
    for (const nlohmann::json& line : lines) {
      flops += kFlopsPerToken * line["tokens"].get<double>();
      seconds += line["step_s"].get<double>();
    }
    const double run_mfu = flops / seconds / 1e12 / (peak > 0 ? peak : 989.0);
    std::printf("summary: MFU %.3e (expected %.3e), peak memory %.2f GiB\n", summary.mfu, run_mfu,
                summary.peak_mem_gib);
    EXPECT_NEAR(summary.mfu, run_mfu, 1e-9 * run_mfu);
    EXPECT_DOUBLE_EQ(summary.peak_mem_gib, 3.0);
    for (const nlohmann::json& line : lines) {
      const double tflops = kFlopsPerToken * line["tokens"].get<double>() / line["step_s"].get<double>() / 1e12;
      const double expected_peak = peak > 0 ? peak : 989.0;
      std::printf("peak %g: tokens %d step_s %.4f tflops %.6f mfu %.3e peak_mem_gib %.2f\n", expected_peak,
                  line["tokens"].get<int>(), line["step_s"].get<double>(), line["tflops"].get<double>(),
                  line["mfu"].get<double>(), line["peak_mem_gib"].get<double>());
      EXPECT_NEAR(line["tflops"].get<double>(), tflops, 1e-9 * tflops);
      EXPECT_NEAR(line["mfu"].get<double>(), tflops / expected_peak, 1e-9 * tflops / expected_peak);
      EXPECT_DOUBLE_EQ(line["peak_mem_gib"].get<double>(), 3.0);
      EXPECT_EQ(line["h2d_bytes"].get<int64_t>(), 1000 * line["tokens"].get<int64_t>());
      EXPECT_EQ(line["d2h_bytes"].get<int64_t>(), 24);
    }
  }
  // The sizing a GPU engine plans for: the token budget and sample cap of the batch plan.
  ASSERT_EQ(sizings.size(), 2u);
  EXPECT_EQ(sizings[0].max_tokens, 256);  // --micro_batch_tokens of small_run_options
  EXPECT_EQ(sizings[0].max_samples, 0);
}

TEST_F(TrainerDeviceMetricsTest, CpuEngineLeavesMfuOut) {
  TrainOptions options = small_run_options(*root_);
  options.output_dir = (*root_ / "run_cpu").string();
  options.max_steps = 1;
  const TrainSummary summary = run_training(options, "cpu");
  EXPECT_EQ(summary.device, "cpu");
  EXPECT_LT(summary.mfu, 0);
  EXPECT_LT(summary.peak_mem_gib, 0);
  const std::vector<nlohmann::json> lines = train_lines(fs::path(options.output_dir) / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_FALSE(lines[0].contains("mfu") || lines[0].contains("tflops") || lines[0].contains("peak_mem_gib") ||
               lines[0].contains("h2d_bytes"))
      << lines[0].dump();
}

}  // namespace
}  // namespace deltamoe
