// Base64 and data-URL decoding.
#include "data/base64.h"

#include <array>

#include "core/error.h"

namespace deltamoe {
namespace {

constexpr int8_t kInvalid = -1, kSkip = -2;

std::array<int8_t, 256> make_table() {
  std::array<int8_t, 256> table;
  table.fill(kInvalid);
  const char* alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  for (int i = 0; i < 64; ++i) table[static_cast<uint8_t>(alphabet[i])] = static_cast<int8_t>(i);
  // URL-safe variants decode too: writers differ and the meaning is unambiguous.
  table['-'] = 62;
  table['_'] = 63;
  for (char c : {' ', '\n', '\r', '\t'}) table[static_cast<uint8_t>(c)] = kSkip;
  return table;
}

}  // namespace

std::optional<std::vector<uint8_t>> base64_decode(std::string_view text) {
  static const std::array<int8_t, 256> kTable = make_table();
  std::vector<uint8_t> out;
  out.reserve(text.size() / 4 * 3 + 3);
  uint32_t bits = 0;
  int num_bits = 0, num_symbols = 0, num_padding = 0;
  for (const char c : text) {
    if (c == '=') {
      ++num_padding;
      continue;
    }
    const int8_t value = kTable[static_cast<uint8_t>(c)];
    if (value == kSkip) continue;
    if (value == kInvalid || num_padding > 0) return std::nullopt;  // data after padding is malformed
    bits = (bits << 6) | static_cast<uint32_t>(value);
    num_bits += 6;
    ++num_symbols;
    if (num_bits >= 8) {
      num_bits -= 8;
      out.push_back(static_cast<uint8_t>((bits >> num_bits) & 0xFF));
    }
  }
  // One symbol left over carries fewer than 8 bits: no valid encoding ends like that.
  if (num_symbols % 4 == 1 || num_padding > 2) return std::nullopt;
  return out;
}

std::vector<uint8_t> decode_data_url(std::string_view url, std::string_view where) {
  const size_t comma = url.find(',');
  CHECK(is_data_url(url) && comma != std::string_view::npos, where, ": malformed data URL (expected data:<type>;base64,<payload>)");
  const std::string_view header = url.substr(0, comma);
  CHECK(header.ends_with(";base64"), where, ": data URL '", header, "' is not base64; only base64 data URLs are supported");
  std::optional<std::vector<uint8_t>> bytes = base64_decode(url.substr(comma + 1));
  CHECK(bytes.has_value(), where, ": data URL payload is not valid base64");
  return std::move(*bytes);
}

}  // namespace deltamoe
