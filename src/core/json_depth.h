// A bound on how deeply a JSON text nests, checked before it is parsed: nlohmann's parser is
// iterative, but printing (dump) and our own recursive walks are not, so a line nested 100,000
// deep would overflow the stack long after the parse succeeded.
#pragma once

#include <cstdint>
#include <string_view>

namespace deltamoe {

// Deep enough for any real chat, tool schema or config (they nest < 20); used by every reader of
// untrusted JSON (dataset lines, tools, safetensors headers).
constexpr int64_t kMaxJsonDepth = 64;

// The deepest nesting of [ and { outside strings (0 for a scalar). Stops counting (and returns
// a value > stop_above) as soon as the depth exceeds stop_above. Malformed text gets a number too;
// the parser reports the syntax error afterwards.
int64_t json_nesting_depth(std::string_view text, int64_t stop_above = kMaxJsonDepth);

}  // namespace deltamoe
