// Builds the "file:line: message" text of a deltamoe::Error.
#include "core/error.h"

#include <cstring>

namespace deltamoe {

void throw_error(const char* file, int line, const std::string& message) {
  // Keep only the path below src/ so messages are stable across checkouts.
  const char* short_file = std::strstr(file, "src/");
  throw Error(str_cat(short_file ? short_file : file, ":", line, ": ", message));
}

}  // namespace deltamoe
