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

// 16 lower-case hex digits.
std::string checksum_hex(uint64_t checksum);

}  // namespace deltamoe
