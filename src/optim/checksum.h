// A fast 64-bit checksum for optimizer-state files: catches truncation and bit rot, not attacks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace deltamoe {

// FNV-1a over 64-bit little-endian words (then the tail bytes), finished with the length.
// Every step is a bijection of the running hash, so a change confined to one word is always
// detected. About one multiply per 8 bytes: several GB/s, fine for multi-GB state shards.
uint64_t checksum64(const void* data, size_t num_bytes);

// The same checksum fed piece by piece: update() over consecutive pieces of any sizes, then
// finish(), equals checksum64 over their concatenation (for streamed reads and writes).
class Checksum64 {
 public:
  void update(const void* data, size_t num_bytes);
  uint64_t finish() const;

 private:
  uint64_t hash_ = 0xcbf29ce484222325ull;
  uint8_t carry_[8] = {};  // bytes of an unfinished word
  size_t carried_ = 0;
  size_t total_ = 0;
};

// 16 lower-case hex digits.
std::string checksum_hex(uint64_t checksum);

}  // namespace deltamoe
