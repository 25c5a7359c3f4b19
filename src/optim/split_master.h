// A split fp32 master: the 32 bits of a tensor's fp32 master weight kept as two 16-bit halves, the
// high one being the bf16 working weight itself (the master rounded to bf16, ties away from
// zero) and the low one the master's lowest 16 bits. The pair gives back the master exactly, so
// AdamW computes on the same fp32 values as with a separate master, and it reads and writes 2 bytes
// a parameter less (no separate bf16 copy to write) and keeps 2 bytes a parameter less.
// Why ties go away from zero: the high half is the bits plus 0x8000, shifted, so the low half's
// sign says which way the rounding went. Round-to-nearest-even cannot be undone from 16 bits: at a
// tie both a rounded-up odd and an unrounded even high half end in the same even bf16 value.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/common/host_device.h"

namespace deltamoe {

// The high half (bf16 bits) of the fp32 bit pattern `bits`: bf16(master) with ties away from zero.
DELTAMOE_HOST_DEVICE inline uint16_t split_master_high(uint32_t bits) {
  return static_cast<uint16_t>((bits + 0x8000u) >> 16);
}
// The low half: the master's lowest 16 bits.
DELTAMOE_HOST_DEVICE inline uint16_t split_master_low(uint32_t bits) { return static_cast<uint16_t>(bits & 0xffffu); }
// The fp32 bit pattern back from its halves: the high half less 1 when the rounding went up (the
// low half read as a signed number is then negative). Exact for every 32-bit pattern (modular).
DELTAMOE_HOST_DEVICE inline uint32_t join_split_master(uint16_t high, uint16_t low) {
  return (static_cast<uint32_t>(high) << 16) + static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(low)));
}

// Host forms over floats (checkpoints, uploads, tests).
inline void split_master(float value, uint16_t& high, uint16_t& low) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  high = split_master_high(bits);
  low = split_master_low(bits);
}
inline float join_split_master_float(uint16_t high, uint16_t low) {
  const uint32_t bits = join_split_master(high, low);
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

}  // namespace deltamoe
