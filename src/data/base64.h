// Standard base64 (RFC 4648, with or without padding) and data URLs ("data:image/png;base64,...")
// for images embedded in dataset lines.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace deltamoe {

// Decoded bytes, or nullopt when the text holds a character outside the alphabet or has a bad length.
// ASCII white space is ignored (some writers wrap long payloads).
std::optional<std::vector<uint8_t>> base64_decode(std::string_view text);

inline bool is_data_url(std::string_view ref) { return ref.starts_with("data:"); }

// The payload of a base64 data URL. Throws deltamoe::Error naming `where` when the URL is not
// base64 or its payload does not decode.
std::vector<uint8_t> decode_data_url(std::string_view url, std::string_view where);

}  // namespace deltamoe
