// Throughput of the whole pipeline (read, parse, decode + preprocess images, render, tokenize,
// label, pack) on generated data: text-only chat, and one 448x448 JPEG per sample; with one worker
// thread and with two. Prints samples/s and tokens/s (recorded in docs/performance.md). The only
// assertions are on completeness; speed is reported, not asserted, since shared machines vary by
// several times, hence label bench (`ctest -L bench`), which CI does not run.
#include <gtest/gtest.h>

#include <chrono>
#include <ctime>

#include "data/data_pipeline.h"
#include "data/data_test_util.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

// Words of 1-3 syllables drawn with a fixed LCG (about 30k distinct words, so the tokenizer's
// piece cache sees a realistic mix of hits and misses), with some punctuation and numbers.
std::string words(uint64_t& state, int count) {
  static const char* kSyllables[] = {"ka", "to", "ren", "mi", "sol", "ther", "in", "ga", "pro", "lu", "ment", "ve",
                                     "qu", "ab", "dor", "sti", "nel", "ox", "ria", "tem", "pa", "zu", "ble", "cor",
                                     "wi", "fan", "ght", "ei", "sy", "on", "ex", "ly"};
  const auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return state >> 33;
  };
  std::string out;
  for (int i = 0; i < count; ++i) {
    if (i) out += next() % 12 == 0 ? ", " : " ";
    if (next() % 20 == 0) {
      out += std::to_string(next() % 10000);
      continue;
    }
    const uint64_t syllables = 1 + next() % 3;
    for (uint64_t k = 0; k < syllables; ++k) out += kSyllables[next() % 32];
  }
  return out;
}

// A photo-like 448x448 JPEG: smooth gradients plus fine noise (so the entropy decoder has work).
std::vector<uint8_t> photo_jpeg(int seed) {
  RgbImage image = image_test::gradient_image(448, 448);
  uint32_t state = static_cast<uint32_t>(seed) * 2654435761u + 1;
  for (uint8_t& value : image.pixels) {
    state = state * 1664525u + 1013904223u;
    value = static_cast<uint8_t>(std::clamp<int>(value + static_cast<int>((state >> 24) % 41) - 20, 0, 255));
  }
  return image_test::encode_jpeg(image, 90);
}

struct Throughput {
  int64_t samples = 0, tokens = 0, batches = 0;
  double seconds = 0;
  double cpu_seconds = 0;  // all threads of the process: the cost on one core
};

Throughput measure(const std::string& path, int workers, int64_t budget) {
  PipelineOptions options;
  options.dataset_paths = {path};
  options.token_budget = budget;
  options.num_workers = workers;
  options.prefetch = 32;
  DataPipeline pipeline(options, data_test::qwen3_tokenizer());
  Throughput result;
  const auto start = std::chrono::steady_clock::now();
  const std::clock_t cpu_start = std::clock();
  while (std::optional<MicroBatch> batch = pipeline.next_batch()) {
    result.samples += batch->num_samples();
    result.tokens += batch->num_tokens();
    ++result.batches;
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.cpu_seconds = static_cast<double>(std::clock() - cpu_start) / CLOCKS_PER_SEC;
  EXPECT_EQ(pipeline.skip_stats().total(), 0) << pipeline.skip_stats().summary();
  EXPECT_EQ(result.samples, pipeline.num_samples());
  return result;
}

void report(const char* name, int workers, const Throughput& t, int64_t budget) {
  std::printf("%-20s workers %d: %5lld samples %7lld tokens | wall %.2f s: %7.1f samples/s %9.0f tokens/s | cpu %.2f s: "
              "%7.1f samples/cpu-s %9.0f tokens/cpu-s | packing %.3f\n",
              name, workers, static_cast<long long>(t.samples), static_cast<long long>(t.tokens), t.seconds, t.samples / t.seconds,
              t.tokens / t.seconds, t.cpu_seconds, t.samples / t.cpu_seconds, t.tokens / t.cpu_seconds,
              static_cast<double>(t.tokens) / (static_cast<double>(t.batches) * static_cast<double>(budget)));
}

TEST(DataPipelineSpeed, TextChatAndOneJpegPerSample) {
  const fs::path folder = data_test::temp_folder();
  constexpr int kTextSamples = 4000, kImageSamples = 400, kDistinctImages = 16;
  uint64_t state = 1;
  std::string text;
  for (int i = 0; i < kTextSamples; ++i) text += data_test::chat_line(words(state, 40), words(state, 120));
  data_test::write_text(folder / "text.jsonl", text);
  // Distinct files so the page cache, not one hot buffer, serves them (as with a real dataset).
  for (int i = 0; i < kDistinctImages; ++i) data_test::write_bytes(folder / ("img" + std::to_string(i) + ".jpg"), photo_jpeg(i));
  std::string images;
  for (int i = 0; i < kImageSamples; ++i) {
    images += R"({"messages": [{"role": "user", "content": "<image>)" + words(state, 12) + R"("}, {"role": "assistant", "content": ")" +
              words(state, 40) + R"("}], "images": ["img)" + std::to_string(i % kDistinctImages) + ".jpg\"]}\n";
  }
  data_test::write_text(folder / "images.jsonl", images);

  constexpr int64_t kBudget = 8192;
  for (const int workers : {1, 2}) {
    report("text chat", workers, measure((folder / "text.jsonl").string(), workers, kBudget), kBudget);
    report("448x448 jpeg/sample", workers, measure((folder / "images.jsonl").string(), workers, kBudget), kBudget);
  }
  fs::remove_all(folder);
}

}  // namespace
}  // namespace deltamoe
