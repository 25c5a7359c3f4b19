// checksum64: FNV-1a over 64-bit words.
#include "optim/checksum.h"

#include <cstdio>
#include <cstring>

namespace deltamoe {

constexpr uint64_t kFnvOffsetBasis = 0xcbf29ce484222325ull;
constexpr uint64_t kFnvPrime = 0x100000001b3ull;

uint64_t checksum64(const void* data, size_t num_bytes) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  uint64_t hash = kFnvOffsetBasis;
  size_t i = 0;
  for (; i + 8 <= num_bytes; i += 8) {
    uint64_t word;
    std::memcpy(&word, bytes + i, 8);  // little-endian hosts only (x86-64, aarch64)
    hash = (hash ^ word) * kFnvPrime;
  }
  for (; i < num_bytes; ++i) hash = (hash ^ bytes[i]) * kFnvPrime;
  return (hash ^ static_cast<uint64_t>(num_bytes)) * kFnvPrime;
}

std::string checksum_hex(uint64_t checksum) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(checksum));
  return text;
}

}  // namespace deltamoe
