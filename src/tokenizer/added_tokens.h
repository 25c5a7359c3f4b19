// Finds added tokens (<|im_start|>, <think>, ...) inside text, as Hugging Face's added vocabulary
// does: leftmost match, the longest one at that position.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace deltamoe {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;     // skipped by decode(skip_special_tokens=true)
  bool normalized = false;  // matched in the normalised text instead of the raw text
};

class AddedTokenMatcher {
 public:
  void add(std::string content, int32_t id);
  bool empty() const { return tokens_.empty(); }

  struct Match {
    size_t begin = std::string_view::npos;  // npos: no match
    size_t end = 0;
    int32_t id = -1;
  };
  // The first match at or after from.
  Match find(std::string_view text, size_t from) const;

 private:
  struct Entry {
    std::string content;
    int32_t id;
  };
  std::vector<Entry> tokens_;
  // first byte -> indices into tokens_, longest content first
  std::array<std::vector<uint32_t>, 256> by_first_byte_;
};

}  // namespace deltamoe
