// The one error type of deltamoe and the CHECK macro that throws it.
// Every failure (bad user input, broken invariant, failed library call) becomes a deltamoe::Error
// carrying file:line and a message that says what is wrong.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace deltamoe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Concatenates any streamable values into one string: str_cat("layer ", 3, ": ", name).
template <typename... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream out;
  ((out << std::forward<Args>(args)), ...);
  return out.str();
}

[[noreturn]] void throw_error(const char* file, int line, const std::string& message);

}  // namespace deltamoe

// CHECK(cond, parts...): throws deltamoe::Error("file:line: parts...") when cond is false.
// The message parts are only evaluated on failure.
#define CHECK(cond, ...)                                                                   \
  do {                                                                                     \
    if (!(cond)) [[unlikely]] {                                                            \
      ::deltamoe::throw_error(__FILE__, __LINE__, ::deltamoe::str_cat(__VA_ARGS__));       \
    }                                                                                      \
  } while (0)

// RAISE(parts...): unconditional error with the same format as CHECK.
#define RAISE(...) ::deltamoe::throw_error(__FILE__, __LINE__, ::deltamoe::str_cat(__VA_ARGS__))
