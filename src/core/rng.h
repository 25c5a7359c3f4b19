// Deterministic counter-based random numbers (Philox4x32-10): the same (seed, stream, index)
// gives the same value on any machine, thread count or device, which makes init and shuffles
// reproducible and resumable.
#pragma once

#include <array>
#include <cstdint>

namespace deltamoe {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

class Rng {
 public:
  explicit Rng(uint64_t seed, uint64_t stream = 0) : seed_(seed), stream_(stream) {}

  uint32_t next_u32();
  uint64_t next_u64();
  // Uniform in [0, 1) with 24 random bits.
  float uniform();
  // Uniform in [0, 1) with 53 random bits.
  double uniform_f64();
  // Standard normal (Box-Muller, fp64 internally).
  double normal();
  // Uniform integer in [0, bound) without modulo bias.
  uint64_t below(uint64_t bound);

  uint64_t position() const { return counter_ * 4 + lane_; }
  void seek(uint64_t position) {
    counter_ = position / 4;
    lane_ = static_cast<int>(position % 4);
    have_block_ = false;
  }

 private:
  uint64_t seed_;
  uint64_t stream_;
  uint64_t counter_ = 0;
  int lane_ = 0;
  bool have_block_ = false;
  std::array<uint32_t, 4> block_{};
};

}  // namespace deltamoe
