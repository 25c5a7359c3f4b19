// Byte counts as the messages, logs and plans print them.
#pragma once

#include <cstddef>

namespace deltamoe {

constexpr double kBytesPerGib = 1024.0 * 1024.0 * 1024.0;

constexpr double gib(size_t bytes) { return static_cast<double>(bytes) / kBytesPerGib; }

}  // namespace deltamoe
