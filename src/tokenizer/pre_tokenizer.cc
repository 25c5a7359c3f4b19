// Hand-written equivalent of the Qwen pre-tokenizer regexes (no regex engine: std::regex is slow
// and lacks \p{..}). Each numbered step below is one alternative of the pattern, tried in order.
#include "tokenizer/pre_tokenizer.h"

#include <cstdint>

#include "tokenizer/unicode.h"

namespace deltamoe {
namespace {

const char* const kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kQwen35Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Per-character facts the pattern looks at, computed once per character.
struct CharInfo {
  uint32_t offset;  // byte offset in the text
  char32_t cp;
  uint8_t flags;    // unicode_data::kLetter, kMark, kNumber, kWhiteSpace
};

bool is_newline(char32_t cp) { return cp == '\r' || cp == '\n'; }

// Case-insensitive match of one contraction letter as Oniguruma folds it: ASCII case, and the long
// s (U+017F), whose case folding is 's'.
bool folds_to(char32_t cp, char lower) {
  if (cp < 0x80) return (cp | 0x20) == static_cast<char32_t>(lower);
  return lower == 's' && cp == 0x17F;
}

// Length in characters of a contraction ('s 't 're 've 'm 'll 'd) at index i, or 0.
size_t contraction_length(const std::vector<CharInfo>& chars, size_t i) {
  const size_t n = chars.size();
  if (chars[i].cp != '\'' || i + 1 >= n) return 0;
  const char32_t a = chars[i + 1].cp;
  if (folds_to(a, 's') || folds_to(a, 't') || folds_to(a, 'm') || folds_to(a, 'd')) return 2;
  if (i + 2 >= n) return 0;
  const char32_t b = chars[i + 2].cp;
  if ((folds_to(a, 'r') || folds_to(a, 'v')) && folds_to(b, 'e')) return 3;
  if (folds_to(a, 'l') && folds_to(b, 'l')) return 3;
  return 0;
}

}  // namespace

std::optional<SplitPattern> split_pattern_from_regex(const std::string& regex) {
  if (regex == kQwen2Regex) return SplitPattern::kQwen2;
  if (regex == kQwen35Regex) return SplitPattern::kQwen35;
  return std::nullopt;
}

void split_pieces(std::string_view text, SplitPattern pattern, std::vector<std::string_view>& pieces) {
  using namespace unicode_data;
  thread_local std::vector<CharInfo> chars;
  chars.clear();
  for (size_t pos = 0; pos < text.size();) {
    const uint32_t offset = static_cast<uint32_t>(pos);
    const char32_t cp = next_code_point(text, pos);
    chars.push_back({offset, cp, flags(cp)});
  }
  const size_t n = chars.size();
  const uint8_t letter_class = pattern == SplitPattern::kQwen35 ? (kLetter | kMark) : kLetter;
  const auto is_letter = [&](size_t i) { return (chars[i].flags & letter_class) != 0; };
  const auto is_space = [&](size_t i) { return (chars[i].flags & kWhiteSpace) != 0; };
  // [^\s\p{L}\p{N}] (Qwen3.5: also not \p{M})
  const auto is_other = [&](size_t i) { return (chars[i].flags & (letter_class | kNumber | kWhiteSpace)) == 0; };
  const auto offset_of = [&](size_t i) { return i < n ? chars[i].offset : static_cast<uint32_t>(text.size()); };

  size_t i = 0;
  while (i < n) {
    size_t end = i;
    const CharInfo& c = chars[i];
    if (size_t length = contraction_length(chars, i); length != 0) {
      // 1. (?i:'s|'t|'re|'ve|'m|'ll|'d)
      end = i + length;
    } else if (is_letter(i) || (!is_newline(c.cp) && (c.flags & (kLetter | kNumber)) == 0 && i + 1 < n &&
                                is_letter(i + 1))) {
      // 2. [^\r\n\p{L}\p{N}]?\p{L}+ : an optional non-letter, non-digit, non-newline prefix, then letters.
      end = i + 1;
      while (end < n && is_letter(end)) ++end;
    } else if (c.flags & kNumber) {
      // 3. \p{N} : one digit at a time.
      end = i + 1;
    } else if (is_other(i) || (c.cp == ' ' && i + 1 < n && is_other(i + 1))) {
      // 4. ' ?[^\s\p{L}\p{N}]+[\r\n]*'
      end = i + 1;
      while (end < n && is_other(end)) ++end;
      while (end < n && is_newline(chars[end].cp)) ++end;
    } else {
      // c is white space here. Find its run.
      size_t run_end = i + 1;
      size_t last_newline = is_newline(c.cp) ? i : SIZE_MAX;
      while (run_end < n && is_space(run_end)) {
        if (is_newline(chars[run_end].cp)) last_newline = run_end;
        ++run_end;
      }
      if (last_newline != SIZE_MAX) {
        end = last_newline + 1;  // 5. \s*[\r\n]+ : up to the last newline of the run
      } else if (run_end == n) {
        end = run_end;           // 6. \s+(?!\S) at the end of the text
      } else if (run_end - i >= 2) {
        end = run_end - 1;       // 6. \s+(?!\S) : leave the last space for the next word
      } else {
        end = run_end;           // 7. \s+
      }
    }
    pieces.push_back(text.substr(offset_of(i), offset_of(end) - offset_of(i)));
    i = end;
  }
}

}  // namespace deltamoe
