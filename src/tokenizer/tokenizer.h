// Byte-level BPE tokenizer loaded from a Hugging Face tokenizer.json (Qwen2, Qwen3, Qwen3.5):
// added tokens found in the raw text, NFC, the Split pre-tokenizer, byte-level BPE; and decoding.
// Tokenizer is cheap to copy (shared, immutable data) and safe to use from many threads.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/added_tokens.h"

namespace deltamoe {

struct TokenizerData;

class Tokenizer {
 public:
  // path: a tokenizer.json, or a model directory that holds one. Throws deltamoe::Error on a
  // missing file, malformed JSON or an unsupported tokenizer kind (says which part).
  static Tokenizer load(const std::string& path);
  // source names the origin in error messages.
  static Tokenizer from_json(std::string_view json_text, const std::string& source);

  // Ids for text (valid UTF-8; throws with the byte offset otherwise). Added and special tokens
  // written in the text are recognised; nothing is prepended or appended.
  std::vector<int32_t> encode(std::string_view text) const;
  void encode_append(std::string_view text, std::vector<int32_t>& ids) const;

  // Text for ids; ill-formed UTF-8 from partial tokens becomes U+FFFD. Throws on an unknown id.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // Id of a vocabulary or added token, exactly as written.
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // Same, but throws naming the token when the tokenizer lacks it.
  int32_t require_token_id(std::string_view token) const;
  // Token text (byte-level form for vocabulary tokens); throws on an unknown id.
  const std::string& id_to_token(int32_t id) const;
  // One more than the largest id.
  int32_t vocab_size() const;
  bool is_special(int32_t id) const;
  // Bytes of normalised text that the token stands for (its content for added tokens).
  size_t token_text_size(int32_t id) const;
  const std::vector<AddedToken>& added_tokens() const;

 private:
  explicit Tokenizer(std::shared_ptr<const TokenizerData> data) : data_(std::move(data)) {}
  void encode_segment(std::string_view normalized, std::vector<int32_t>& ids) const;
  void encode_normalized(std::string_view raw_segment, std::vector<int32_t>& ids) const;

  std::shared_ptr<const TokenizerData> data_;
};

}  // namespace deltamoe
