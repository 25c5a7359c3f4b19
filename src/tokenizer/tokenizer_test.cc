// Unit tests of the tokenizer parts that need no reference program: NFC, the Split pre-tokenizer,
// byte-level decoding, BPE merge order, added tokens, and error reporting on bad input.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <unistd.h>
#include <vector>

#include "core/error.h"
#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace deltamoe {
namespace {

std::vector<std::string> pieces_of(std::string_view text, SplitPattern pattern = SplitPattern::kQwen2) {
  std::vector<std::string_view> pieces;
  split_pieces(text, pattern, pieces);
  return {pieces.begin(), pieces.end()};
}

TEST(Unicode, NfcComposesReordersAndKeepsHangul) {
  EXPECT_EQ(nfc_normalize("e\xCC\x81"), "\xC3\xA9");                       // e + acute -> é
  EXPECT_EQ(nfc_normalize("a\xCC\xA3\xCC\x82"), "\xE1\xBA\xAD");           // a + dot below + circumflex -> ậ
  EXPECT_EQ(nfc_normalize("a\xCC\x82\xCC\xA3"), "\xE1\xBA\xAD");           // same after canonical reordering
  EXPECT_EQ(nfc_normalize("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8"), "\xEA\xB0\x81");  // jamo -> 각
  EXPECT_EQ(nfc_normalize("\xE2\x84\xAB"), "\xC3\x85");                    // Angstrom sign -> Å (singleton)
  EXPECT_EQ(nfc_normalize("plain ascii"), "plain ascii");
  EXPECT_TRUE(is_nfc_quick("caf\xC3\xA9"));
  EXPECT_FALSE(is_nfc_quick("cafe\xCC\x81"));
}

TEST(Unicode, Utf8Validation) {
  EXPECT_EQ(utf8_error_offset("ok \xE4\xBD\xA0"), std::string_view::npos);
  EXPECT_EQ(utf8_error_offset("ab\xFF"), 2u);
  EXPECT_EQ(utf8_error_offset("a\xC0\xAF"), 1u);          // overlong
  EXPECT_EQ(utf8_error_offset("\xED\xA0\x80"), 0u);       // surrogate
  EXPECT_EQ(utf8_error_offset("xy\xE4\xBD"), 2u);         // truncated
  EXPECT_EQ(utf8_lossy("a\xE4\xBD" "b\xFF"), "a\xEF\xBF\xBD" "b\xEF\xBF\xBD");
}

TEST(PreTokenizer, QwenRegexPieces) {
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces_of("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(pieces_of("don't WE'LL"), (V{"don", "'t", " WE", "'LL"}));
  EXPECT_EQ(pieces_of("a   b"), (V{"a", "  ", " b"}));
  EXPECT_EQ(pieces_of("x\n\n  y"), (V{"x", "\n\n", " ", " y"}));
  EXPECT_EQ(pieces_of("12345"), (V{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(pieces_of(" ++x;\n"), (V{" ++", "x", ";\n"}));
  EXPECT_EQ(pieces_of("end  "), (V{"end", "  "}));
  EXPECT_EQ(pieces_of("\tword"), (V{"\tword"}));
  // A combining mark splits a Qwen3 word but stays inside a Qwen3.5 word.
  EXPECT_EQ(pieces_of("cafe\xCC\x81s"), (V{"cafe", "\xCC\x81s"}));
  EXPECT_EQ(pieces_of("cafe\xCC\x81s", SplitPattern::kQwen35), (V{"cafe\xCC\x81s"}));
  EXPECT_FALSE(split_pattern_from_regex("\\w+").has_value());
}

TEST(ByteLevel, AlphabetRoundTrip) {
  EXPECT_EQ(byte_level_char(' '), "\xC4\xA0");   // Ġ
  EXPECT_EQ(byte_level_char('\n'), "\xC4\x8A");  // Ċ
  EXPECT_EQ(byte_level_char('a'), "a");
  for (int byte = 0; byte < 256; ++byte) {
    EXPECT_EQ(byte_level_decode_token(byte_level_char(static_cast<uint8_t>(byte))), std::string(1, static_cast<char>(byte)));
  }
  EXPECT_EQ(byte_level_decode_token("\xE4\xBD\xA0"), "\xE4\xBD\xA0");  // not in the alphabet: kept as is
}

// The direct scan (short pieces) and the priority queue (long pieces) merge in the same order.
TEST(Bpe, LongAndShortPiecesMergeAlike) {
  std::array<int32_t, 256> byte_ids{};
  for (int b = 0; b < 256; ++b) byte_ids[b] = b;
  BpeMerges merges;
  merges.add('a', 'a', 300, 0);  // "aa"
  merges.add(300, 300, 301, 1);  // "aaaa"
  merges.add('a', 'b', 302, 2);  // "ab"
  merges.add(301, 'a', 303, 3);  // "aaaaa"
  merges.finish();
  for (int length = 1; length < 200; ++length) {
    std::string piece;
    for (int i = 0; i < length; ++i) piece += (i % 7 == 6) ? 'b' : 'a';
    std::vector<int32_t> ids;
    bpe_merge_piece(piece, byte_ids, merges, ids);
    // Expected by brute force: merge the lowest-ranked, leftmost pair until none is left.
    std::vector<int32_t> expected(piece.begin(), piece.end());
    while (true) {
      int best = -1, best_rank = 1 << 30, merged = 0;
      for (size_t i = 0; i + 1 < expected.size(); ++i) {
        const BpeMerges::Merge m = merges.find(expected[i], expected[i + 1]);
        if (m.rank >= 0 && m.rank < best_rank) best = static_cast<int>(i), best_rank = m.rank, merged = m.merged;
      }
      if (best < 0) break;
      expected[best] = merged;
      expected.erase(expected.begin() + best + 1);
    }
    ASSERT_EQ(ids, expected) << "length " << length;
  }
}

// A small tokenizer.json written by the test: bytes, two merges, two added tokens.
std::string tiny_tokenizer_json(const std::string& regex_override = "") {
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_level_char(static_cast<uint8_t>(b))] = b;
  vocab["he"] = 256;
  vocab["hel"] = 257;
  const std::string regex = regex_override.empty()
      ? R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"
      : regex_override;
  nlohmann::ordered_json root = {
      {"added_tokens", {{{"id", 300}, {"content", "<|end|>"}, {"special", true}, {"normalized", false}},
                        {{"id", 301}, {"content", "<x>"}, {"special", false}, {"normalized", false}}}},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", {
          {{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"h e", {"he", "l"}}}}}};
  return root.dump();
}

TEST(Tokenizer, EncodeDecodeWithAddedTokens) {
  const Tokenizer tokenizer = Tokenizer::from_json(tiny_tokenizer_json(), "tiny");
  EXPECT_EQ(tokenizer.encode("hello<|end|>"), (std::vector<int32_t>{257, 'l', 'o', 300}));
  EXPECT_EQ(tokenizer.encode("<x><|end|><|en"), (std::vector<int32_t>{301, 300, '<', '|', 'e', 'n'}));
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("hel<|end|>lo")), "hel<|end|>lo");
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("hel<|end|>lo"), /*skip_special_tokens=*/true), "hello");
  EXPECT_EQ(tokenizer.decode(std::vector<int32_t>{0xE4, 0xBD}), "\xEF\xBF\xBD");  // half a character
  EXPECT_EQ(tokenizer.token_to_id("<|end|>"), 300);
  EXPECT_EQ(tokenizer.vocab_size(), 302);
  EXPECT_TRUE(tokenizer.is_special(300));
  EXPECT_FALSE(tokenizer.is_special(301));
  EXPECT_THROW(tokenizer.encode("bad \xFF byte"), Error);
  EXPECT_THROW(tokenizer.decode(std::vector<int32_t>{999}), Error);
  EXPECT_THROW(tokenizer.require_token_id("<missing>"), Error);
}

TEST(Tokenizer, BadFilesAreReported) {
  EXPECT_THROW(Tokenizer::load("/nonexistent/tokenizer.json"), Error);
  EXPECT_THROW(Tokenizer::from_json("{not json", "bad"), Error);
  EXPECT_THROW(Tokenizer::from_json(R"({"model": {"type": "WordPiece"}})", "bad"), Error);
  EXPECT_THROW(Tokenizer::from_json(tiny_tokenizer_json("\\w+"), "bad"), Error);
  nlohmann::json with_bos = nlohmann::json::parse(tiny_tokenizer_json());
  with_bos["post_processor"] = {{"type", "TemplateProcessing"},
                                {"single", {{{"SpecialToken", {{"id", "<|end|>"}}}}, {{"Sequence", {{"id", "A"}}}}}}};
  EXPECT_THROW(Tokenizer::from_json(with_bos.dump(), "bos"), Error);
  with_bos["post_processor"]["single"].erase(0);
  EXPECT_NO_THROW(Tokenizer::from_json(with_bos.dump(), "no bos"));
  try {
    Tokenizer::from_json(tiny_tokenizer_json("\\w+"), "my.json");
    FAIL();
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("my.json"), std::string::npos) << error.what();
  }
}

// `deltamoe tokenize` end to end on the tiny tokenizer, with several threads and a bad line.
TEST(TokenizeCommand, WritesOneIdsLinePerTextLine) {
  const char* binary = std::getenv("DELTAMOE_BINARY");
  ASSERT_NE(binary, nullptr) << "DELTAMOE_BINARY is not set (run through ctest)";
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("deltamoe_tokenize_cmd_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << tiny_tokenizer_json();
  std::ofstream(dir / "in.jsonl") << R"({"text": "hello"})" << "\n" << R"({"text": "he<|end|>"})" << "\n"
                                  << R"({"text": ""})" << "\n";
  const std::string base = std::string(binary) + " tokenize --tokenizer " + dir.string() + " --out " + (dir / "out.jsonl").string();
  ASSERT_EQ(std::system((base + " --threads 2 --in " + (dir / "in.jsonl").string()).c_str()), 0);
  std::ifstream out(dir / "out.jsonl");
  std::vector<std::string> lines;
  for (std::string line; std::getline(out, line);) lines.push_back(line);
  EXPECT_EQ(lines, (std::vector<std::string>{R"({"ids": [257, 108, 111]})", R"({"ids": [256, 300]})", R"({"ids": []})"}));
  std::ofstream(dir / "bad.jsonl") << R"({"text": "ok"})" << "\n" << R"({"txt": 1})" << "\n";
  EXPECT_NE(std::system((base + " --in " + (dir / "bad.jsonl").string() + " 2>/dev/null").c_str()), 0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace deltamoe
