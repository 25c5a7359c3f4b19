// Byte-level alphabet (bytes <-> printable code points) and lossy UTF-8 repair for decoding.
#include "tokenizer/byte_level.h"

#include <optional>
#include <vector>

#include "tokenizer/unicode.h"

namespace deltamoe {
namespace {

// Printable bytes stand for themselves; the others (controls, space, 0x7F-0xA0, 0xAD) are
// shifted to U+0100 and up, in byte order.
std::array<char32_t, 256> make_alphabet() {
  std::array<char32_t, 256> alphabet{};
  char32_t next_shifted = 0x100;
  for (int byte = 0; byte < 256; ++byte) {
    const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE;
    alphabet[byte] = printable ? static_cast<char32_t>(byte) : next_shifted++;
  }
  return alphabet;
}

// Code point (< 0x144) -> byte, or -1.
const std::vector<int>& inverse_alphabet() {
  static const std::vector<int> inverse = [] {
    std::vector<int> table(0x200, -1);
    const auto& alphabet = byte_level_alphabet();
    for (int byte = 0; byte < 256; ++byte) table[alphabet[byte]] = byte;
    return table;
  }();
  return inverse;
}

}  // namespace

const std::array<char32_t, 256>& byte_level_alphabet() {
  static const std::array<char32_t, 256> alphabet = make_alphabet();
  return alphabet;
}

std::string byte_level_char(uint8_t byte) {
  std::string out;
  append_utf8(byte_level_alphabet()[byte], out);
  return out;
}

std::string byte_level_decode_token(std::string_view token) {
  const auto& inverse = inverse_alphabet();
  std::string bytes;
  bytes.reserve(token.size());
  for (size_t pos = 0; pos < token.size();) {
    const char32_t cp = next_code_point(token, pos);
    if (cp >= inverse.size() || inverse[cp] < 0) return std::string(token);
    bytes.push_back(static_cast<char>(inverse[cp]));
  }
  return bytes;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    const size_t bad = utf8_error_offset(bytes.substr(pos));
    if (bad == std::string_view::npos) {
      out.append(bytes.substr(pos));
      break;
    }
    out.append(bytes.substr(pos, bad));
    pos += bad;
    // The maximal subpart: a valid lead byte followed by the continuation bytes that could still
    // have completed it (second-byte ranges per the Unicode table of well-formed sequences).
    const unsigned char lead = static_cast<unsigned char>(bytes[pos]);
    int length = 0;
    unsigned char low = 0x80, high = 0xBF;
    if (lead >= 0xC2 && lead <= 0xDF) length = 2;
    else if (lead >= 0xE0 && lead <= 0xEF) length = 3, low = lead == 0xE0 ? 0xA0 : 0x80, high = lead == 0xED ? 0x9F : 0xBF;
    else if (lead >= 0xF0 && lead <= 0xF4) length = 4, low = lead == 0xF0 ? 0x90 : 0x80, high = lead == 0xF4 ? 0x8F : 0xBF;
    size_t consumed = 1;
    for (int k = 1; k < length && pos + consumed < bytes.size(); ++k) {
      const unsigned char byte = static_cast<unsigned char>(bytes[pos + consumed]);
      const bool ok = k == 1 ? (byte >= low && byte <= high) : (byte >= 0x80 && byte <= 0xBF);
      if (!ok) break;
      ++consumed;
    }
    out.append("\xEF\xBF\xBD");
    pos += consumed;
  }
  return out;
}

}  // namespace deltamoe
