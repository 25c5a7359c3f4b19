// The progress line and metrics.jsonl with and without the GPU engine's MFU and memory fields, and
// the peak FLOP/s the MFU is taken against when --peak_tflops is not given.
#include "train/train_metrics.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <signal.h>
#include <unistd.h>

namespace deltamoe {
namespace {

StepMetrics cpu_step() {
  StepMetrics m;
  m.step = 12;
  m.total_steps = 100;
  m.loss = 3.2104;
  m.token_acc = 0.412;
  m.lr = 9.51e-5;
  m.grad_norm = 1.234;
  m.tokens_per_s = 2100;
  m.step_s = 0.41;
  m.eta_s = 36;
  return m;
}

TEST(ProgressLine, CpuEngineHasNoMfuOrMemory) {
  const std::string line = format_progress_line(cpu_step());
  std::printf("%s\n", line.c_str());
  EXPECT_EQ(line, "step 12/100 | loss 3.2104 | acc 0.412 | lr 9.51e-05 | grad_norm 1.234 | 2.1k tok/s | 0.41 s/step | "
                  "ETA 36s");
}

TEST(ProgressLine, GpuEngineAddsMfuAndMemory) {
  StepMetrics m = cpu_step();
  m.tflops = 407.3;
  m.mfu = 407.3 / 989.0;
  m.peak_mem_gib = 61.26;
  const std::string line = format_progress_line(m);
  std::printf("%s\n", line.c_str());
  EXPECT_NE(line.find("| 2.1k tok/s | MFU 41.2% (407 TFLOP/s) | mem 61.3 GiB | 0.41 s/step |"), std::string::npos)
      << line;
  m.mfu = -1;  // no known peak: the rate alone
  const std::string no_peak = format_progress_line(m);
  std::printf("%s\n", no_peak.c_str());
  EXPECT_NE(no_peak.find("| 2.1k tok/s | 407 TFLOP/s | mem 61.3 GiB |"), std::string::npos) << no_peak;
  EXPECT_EQ(no_peak.find("MFU"), std::string::npos) << no_peak;
}

TEST(MetricsLog, WritesGpuFieldsOnlyWhenReported) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("deltamoe_metrics_" + std::to_string(::getpid()) + ".jsonl")).string();
  {
    MetricsLog log(path, -1);
    log.write_step(cpu_step());
    StepMetrics gpu = cpu_step();
    gpu.tflops = 12.5;
    gpu.mfu = 0.0126;
    gpu.peak_mem_gib = 3.5;
    log.write_step(gpu);
  }
  std::ifstream in(path);
  std::string first, second;
  ASSERT_TRUE(std::getline(in, first) && std::getline(in, second));
  const nlohmann::json cpu = nlohmann::json::parse(first), gpu = nlohmann::json::parse(second);
  EXPECT_FALSE(cpu.contains("mfu") || cpu.contains("tflops") || cpu.contains("peak_mem_gib")) << first;
  EXPECT_DOUBLE_EQ(gpu.at("tflops").get<double>(), 12.5);
  EXPECT_DOUBLE_EQ(gpu.at("mfu").get<double>(), 0.0126);
  EXPECT_DOUBLE_EQ(gpu.at("peak_mem_gib").get<double>(), 3.5);
  std::filesystem::remove(path);
}

std::string temp_metrics_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("deltamoe_" + name + "_" + std::to_string(::getpid()) + ".jsonl"))
      .string();
}

StepMetrics step_number(int64_t step, double loss = 3.2104) {
  StepMetrics m = cpu_step();
  m.step = step;
  m.loss = loss;
  return m;
}

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Two logs on one file (what two runs in one folder did; the run lock now refuses the second run)
// never tear a line: the second one's rewrite replaces the file by a rename, so the first one's
// later lines go to the replaced file and every line in the file is whole. (Before: both opened it
// with O_TRUNC and wrote at their own offsets, leaving holes of NUL bytes and cut lines.)
TEST(MetricsLog, TwoWritersNeverTearALine) {
  const std::string path = temp_metrics_path("metrics_two");
  {
    MetricsLog first(path, -1);
    for (int64_t step = 1; step <= 3; ++step) first.write_step(step_number(step));
    MetricsLog second(path, 3);  // a resume that keeps steps <= 3
    for (int64_t step = 4; step <= 6; ++step) {  // lines of different lengths from the two
      first.write_step(step_number(step, 1.0 / 3.0));
      second.write_step(step_number(step));
    }
  }
  const std::vector<std::string> lines = lines_of(path);
  EXPECT_EQ(lines.size(), 3u + 3u);  // the kept steps 1..3 and the second log's 4..6
  for (const std::string& line : lines) EXPECT_TRUE(nlohmann::json::accept(line)) << "torn line: " << line;
  std::filesystem::remove(path);
}

// The resume-time rewrite goes through a temporary file and a rename: a kill -9 in the middle
// leaves the previous file whole. (Before: the file was truncated first, so a kill left 0 bytes.)
TEST(MetricsLog, AKillDuringTheRewriteLeavesTheOldFile) {
  const std::string path = temp_metrics_path("metrics_kill");
  {
    MetricsLog log(path, -1);
    for (int64_t step = 1; step <= 4; ++step) log.write_step(step_number(step));
  }
  const std::vector<std::string> before = lines_of(path);
  ASSERT_EQ(before.size(), 4u);
  EXPECT_EXIT(
      {
        setenv("DELTAMOE_KILL_AT", "metrics_rewrite", 1);
        MetricsLog resumed(path, 2);
        _exit(0);
      },
      ::testing::KilledBySignal(SIGKILL), "");
  EXPECT_EQ(lines_of(path), before);
  {
    MetricsLog resumed(path, 2);
    resumed.write_step(step_number(3));
  }
  const std::vector<std::string> after = lines_of(path);
  ASSERT_EQ(after.size(), 3u);
  EXPECT_EQ(after[0], before[0]);
  EXPECT_EQ(after[1], before[1]);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  std::filesystem::remove(path);
}

TEST(DefaultPeakTflops, ByGpuName) {
  EXPECT_EQ(default_peak_tflops("NVIDIA H200"), 989.0);  // the value deltamoe bench uses
  EXPECT_EQ(default_peak_tflops("NVIDIA H100 80GB HBM3"), 989.0);
  EXPECT_EQ(default_peak_tflops("NVIDIA H100 PCIe"), 756.0);
  EXPECT_EQ(default_peak_tflops("NVIDIA A800-SXM4-80GB"), 312.0);
  EXPECT_EQ(default_peak_tflops("NVIDIA A100-SXM4-40GB"), 312.0);
  EXPECT_EQ(default_peak_tflops("NVIDIA GeForce RTX 4090"), 0.0);  // unknown: MFU needs --peak_tflops
  EXPECT_EQ(default_peak_tflops(""), 0.0);
}

}  // namespace
}  // namespace deltamoe
