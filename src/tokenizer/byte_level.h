// The GPT-2 byte-level alphabet: every byte maps to one printable code point, so that a byte
// string becomes a text token (e.g. ' ' -> 'Ġ', '\n' -> 'Ċ'), and back.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace deltamoe {

// byte -> code point of the alphabet.
const std::array<char32_t, 256>& byte_level_alphabet();

// The UTF-8 token text for one byte.
std::string byte_level_char(uint8_t byte);

// Maps a token's text back to bytes, as the ByteLevel decoder does: when every code point is in
// the alphabet, the bytes they stand for; otherwise the token's own UTF-8 bytes.
std::string byte_level_decode_token(std::string_view token);

// Rust's String::from_utf8_lossy: each maximal ill-formed subpart becomes U+FFFD.
std::string utf8_lossy(std::string_view bytes);

}  // namespace deltamoe
