// UTF-8 helpers and NFC normalisation (UAX #15) on the generated Unicode tables.
#include "tokenizer/unicode.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace deltamoe {
namespace {

using unicode_data::combining_class;

// Hangul syllables compose and decompose by arithmetic, not by table (Unicode §3.12).
constexpr char32_t kHangulBase = 0xAC00, kLeadBase = 0x1100, kVowelBase = 0x1161, kTrailBase = 0x11A7;
constexpr int kNumVowels = 21, kNumTrails = 28, kNumSyllables = 19 * kNumVowels * kNumTrails;

const unicode_data::Decomposition* find_decomposition(char32_t cp) {
  const auto* begin = unicode_data::kDecompositions;
  const auto* end = begin + unicode_data::kNumDecompositions;
  const auto* it = std::lower_bound(begin, end, cp, [](const auto& d, char32_t key) { return d.code_point < key; });
  return it != end && it->code_point == cp ? it : nullptr;
}

void decompose(char32_t cp, std::vector<char32_t>& out) {
  if (cp >= kHangulBase && cp < kHangulBase + kNumSyllables) {
    const int index = static_cast<int>(cp - kHangulBase);
    out.push_back(kLeadBase + index / (kNumVowels * kNumTrails));
    out.push_back(kVowelBase + (index % (kNumVowels * kNumTrails)) / kNumTrails);
    if (index % kNumTrails != 0) out.push_back(kTrailBase + index % kNumTrails);
    return;
  }
  const auto* decomposition = find_decomposition(cp);
  if (decomposition == nullptr) {
    out.push_back(cp);
    return;
  }
  decompose(decomposition->first, out);
  if (decomposition->second != 0) decompose(decomposition->second, out);
}

// The primary composite of (first, second), or 0 when there is none.
char32_t compose(char32_t first, char32_t second) {
  if (first >= kLeadBase && first < kLeadBase + 19 && second >= kVowelBase && second < kVowelBase + kNumVowels) {
    return kHangulBase + ((first - kLeadBase) * kNumVowels + (second - kVowelBase)) * kNumTrails;
  }
  if (first >= kHangulBase && first < kHangulBase + kNumSyllables && (first - kHangulBase) % kNumTrails == 0 &&
      second > kTrailBase && second < kTrailBase + kNumTrails) {
    return first + (second - kTrailBase);
  }
  const auto* begin = unicode_data::kCompositions;
  const auto* end = begin + unicode_data::kNumCompositions;
  const auto* it = std::lower_bound(begin, end, std::pair{first, second}, [](const auto& c, const auto& key) {
    return c.first != key.first ? c.first < key.first : c.second < key.second;
  });
  return it != end && it->first == first && it->second == second ? it->composite : 0;
}

}  // namespace

size_t utf8_error_offset(std::string_view text) {
  size_t pos = 0;
  const size_t size = text.size();
  while (pos < size) {
    const unsigned char lead = static_cast<unsigned char>(text[pos]);
    if (lead < 0x80) {
      ++pos;
      continue;
    }
    int length = 0;
    char32_t min_value = 0;
    if (lead >= 0xC2 && lead <= 0xDF) {
      length = 2, min_value = 0x80;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      length = 3, min_value = 0x800;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      length = 4, min_value = 0x10000;
    } else {
      return pos;
    }
    if (pos + length > size) return pos;
    for (int i = 1; i < length; ++i) {
      if ((static_cast<unsigned char>(text[pos + i]) & 0xC0) != 0x80) return pos;
    }
    size_t next = pos;
    const char32_t cp = next_code_point(text, next);
    if (cp < min_value || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return pos;
    pos = next;
  }
  return std::string_view::npos;
}

void append_utf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool is_nfc_quick(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    // Everything below U+0300 is NFC-stable with combining class 0.
    if (static_cast<unsigned char>(text[pos]) < 0xCC) {
      pos += static_cast<unsigned char>(text[pos]) < 0x80 ? 1 : 2;
      continue;
    }
    if (unicode_data::flags(next_code_point(text, pos)) & unicode_data::kNfcUnsafe) return false;
  }
  return true;
}

std::string nfc_normalize(std::string_view text) {
  if (is_nfc_quick(text)) return std::string(text);
  std::vector<char32_t> chars;
  chars.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) decompose(next_code_point(text, pos), chars);

  // Canonical ordering: stable sort of each run of non-starters by combining class.
  for (size_t i = 0; i < chars.size();) {
    if (combining_class(chars[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < chars.size() && combining_class(chars[j]) != 0) ++j;
    std::stable_sort(chars.begin() + i, chars.begin() + j,
                     [](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }

  // Canonical composition: each character composes with the last starter unless a character
  // between them blocks it (same or higher combining class, or a starter).
  std::vector<char32_t> composed;
  composed.reserve(chars.size());
  size_t starter = SIZE_MAX;
  int last_class = -1;
  for (char32_t cp : chars) {
    const int cp_class = combining_class(cp);
    if (starter != SIZE_MAX) {
      const bool blocked = last_class != -1 && (last_class == 0 || last_class >= cp_class);
      if (!blocked) {
        const char32_t composite = compose(composed[starter], cp);
        if (composite != 0) {
          composed[starter] = composite;
          continue;
        }
      }
    }
    if (cp_class == 0) {
      starter = composed.size();
      last_class = -1;
    } else {
      last_class = cp_class;
    }
    composed.push_back(cp);
  }
  std::string out;
  out.reserve(text.size() + 8);
  for (char32_t cp : composed) append_utf8(cp, out);
  return out;
}

}  // namespace deltamoe
