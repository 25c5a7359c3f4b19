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

void Checksum64::update(const void* data, size_t num_bytes) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  total_ += num_bytes;
  size_t i = 0;
  while (carried_ > 0 && carried_ < 8 && i < num_bytes) carry_[carried_++] = bytes[i++];
  if (carried_ == 8) {
    uint64_t word;
    std::memcpy(&word, carry_, 8);
    hash_ = (hash_ ^ word) * kFnvPrime;
    carried_ = 0;
  }
  for (; i + 8 <= num_bytes; i += 8) {
    uint64_t word;
    std::memcpy(&word, bytes + i, 8);
    hash_ = (hash_ ^ word) * kFnvPrime;
  }
  for (; i < num_bytes; ++i) carry_[carried_++] = bytes[i];
}

uint64_t Checksum64::finish() const {
  uint64_t hash = hash_;
  for (size_t i = 0; i < carried_; ++i) hash = (hash ^ carry_[i]) * kFnvPrime;
  return (hash ^ static_cast<uint64_t>(total_)) * kFnvPrime;
}

std::string checksum_hex(uint64_t checksum) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(checksum));
  return text;
}

}  // namespace deltamoe
