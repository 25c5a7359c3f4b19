// Added-token matching: candidates are bucketed by first byte and tried longest first, which
// gives the leftmost-longest match that Hugging Face's Aho-Corasick automaton finds.
#include "tokenizer/added_tokens.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace deltamoe {

void AddedTokenMatcher::add(std::string content, int32_t id) {
  CHECK(!content.empty(), "added token ", id, " has empty content");
  const unsigned char first = static_cast<unsigned char>(content[0]);
  tokens_.push_back({std::move(content), id});
  auto& bucket = by_first_byte_[first];
  bucket.push_back(static_cast<uint32_t>(tokens_.size() - 1));
  std::stable_sort(bucket.begin(), bucket.end(),
                   [&](uint32_t a, uint32_t b) { return tokens_[a].content.size() > tokens_[b].content.size(); });
}

AddedTokenMatcher::Match AddedTokenMatcher::find(std::string_view text, size_t from) const {
  if (tokens_.empty()) return {};
  for (size_t pos = from; pos < text.size(); ++pos) {
    const auto& bucket = by_first_byte_[static_cast<unsigned char>(text[pos])];
    for (uint32_t index : bucket) {
      const std::string& content = tokens_[index].content;
      if (content.size() <= text.size() - pos && std::memcmp(text.data() + pos, content.data(), content.size()) == 0) {
        return {pos, pos + content.size(), tokens_[index].id};
      }
    }
  }
  return {};
}

}  // namespace deltamoe
