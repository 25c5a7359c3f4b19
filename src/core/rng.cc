// Philox4x32-10 (Salmon et al., SC'11) and the samplers built on it.
#include "core/rng.h"

#include <cmath>

namespace deltamoe {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint64_t product0 = static_cast<uint64_t>(kMul0) * counter[0];
    uint64_t product1 = static_cast<uint64_t>(kMul1) * counter[2];
    std::array<uint32_t, 4> next = {
        static_cast<uint32_t>(product1 >> 32) ^ counter[1] ^ key[0], static_cast<uint32_t>(product1),
        static_cast<uint32_t>(product0 >> 32) ^ counter[3] ^ key[1], static_cast<uint32_t>(product0)};
    counter = next;
    key[0] += kWeyl0;
    key[1] += kWeyl1;
  }
  return counter;
}

uint32_t Rng::next_u32() {
  if (!have_block_) {
    block_ = philox4x32({static_cast<uint32_t>(counter_), static_cast<uint32_t>(counter_ >> 32),
                         static_cast<uint32_t>(stream_), static_cast<uint32_t>(stream_ >> 32)},
                        {static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32)});
    have_block_ = true;
  }
  uint32_t value = block_[lane_];
  if (++lane_ == 4) {
    lane_ = 0;
    ++counter_;
    have_block_ = false;
  }
  return value;
}

uint64_t Rng::next_u64() {
  uint64_t high = next_u32();
  return (high << 32) | next_u32();
}

float Rng::uniform() { return static_cast<float>(next_u32() >> 8) * (1.0f / 16777216.0f); }

double Rng::uniform_f64() { return static_cast<double>(next_u64() >> 11) * (1.0 / 9007199254740992.0); }

double Rng::normal() {
  // 1 - u keeps the log argument in (0, 1].
  double u1 = 1.0 - uniform_f64();
  double u2 = uniform_f64();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

uint64_t Rng::below(uint64_t bound) {
  if (bound <= 1) return 0;
  uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
  uint64_t value;
  do {
    value = next_u64();
  } while (value >= limit);
  return value % bound;
}

}  // namespace deltamoe
