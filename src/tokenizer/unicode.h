// UTF-8 decoding/encoding and Unicode normalisation form C, on the generated tables of
// unicode_tables.cc (no ICU). Text passed in must be valid UTF-8 (see utf8_error_offset).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "tokenizer/unicode_tables.h"

namespace deltamoe {

// Byte offset of the first ill-formed UTF-8 sequence (overlong, surrogate, > U+10FFFF,
// truncated), or std::string_view::npos when the text is valid.
size_t utf8_error_offset(std::string_view text);

// Decodes the code point starting at text[pos] and advances pos. Requires valid UTF-8.
inline char32_t next_code_point(std::string_view text, size_t& pos) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(pos);
  if (lead < 0x80) {
    pos += 1;
    return lead;
  }
  if (lead < 0xE0) {
    const char32_t cp = ((lead & 0x1Fu) << 6) | (byte(pos + 1) & 0x3Fu);
    pos += 2;
    return cp;
  }
  if (lead < 0xF0) {
    const char32_t cp = ((lead & 0x0Fu) << 12) | ((byte(pos + 1) & 0x3Fu) << 6) | (byte(pos + 2) & 0x3Fu);
    pos += 3;
    return cp;
  }
  const char32_t cp = ((lead & 0x07u) << 18) | ((byte(pos + 1) & 0x3Fu) << 12) |
                      ((byte(pos + 2) & 0x3Fu) << 6) | (byte(pos + 3) & 0x3Fu);
  pos += 4;
  return cp;
}

void append_utf8(char32_t cp, std::string& out);

// True when no code point of the text can change under NFC (quick check), so it is NFC already.
bool is_nfc_quick(std::string_view text);

// Canonical decomposition, canonical ordering and canonical composition (UAX #15), Hangul
// included. Returns the text unchanged (copied) when the quick check passes.
std::string nfc_normalize(std::string_view text);

}  // namespace deltamoe
