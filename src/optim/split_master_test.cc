// The split fp32 master (split_master.h): every 32-bit pattern of a wide sample comes back exactly
// from its halves, and the high half is the bf16 rounding of the master, equal to
// round-to-nearest-even except at exact ties, which it rounds away from zero.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "optim/split_master.h"

namespace deltamoe {
namespace {

float float_of(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

TEST(SplitMaster, EveryHighHalfWithManyLowHalvesRoundTrips) {
  // All 65,536 high halves against 4,096 low halves each: the stride-16 ones plus the rounding's
  // edges (0, the tie 0x8000 and its neighbours, 0xffff).
  const uint32_t edges[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xfffe, 0xffff};
  int64_t checked = 0, mismatches = 0, ties_away = 0, rounding_wrong = 0;
  auto check = [&](uint32_t bits) {
    const uint16_t high = split_master_high(bits), low = split_master_low(bits);
    mismatches += join_split_master(high, low) != bits;
    ++checked;
    const float x = float_of(bits);
    if (!std::isfinite(x)) return;
    const float rounded = bf16_bits_to_float(high);
    const float nearest_even = bf16_bits_to_float(float_to_bf16_bits(x));
    if ((bits & 0xffffu) == 0x8000u) {  // a tie: away from zero, one bf16 step beyond the truncation
      ties_away += std::fabs(rounded) >= std::fabs(x);
      rounding_wrong += std::fabs(rounded) < std::fabs(x);
    } else {
      rounding_wrong += std::memcmp(&rounded, &nearest_even, 4) != 0;
    }
  };
  for (uint32_t high = 0; high <= 0xffffu; ++high) {
    for (uint32_t low = 0; low <= 0xffffu; low += 16) check((high << 16) | low);
    for (uint32_t low : edges) check((high << 16) | low);
  }
  std::printf("split master: %lld patterns, %lld not recovered, %lld ties rounded away, %lld roundings wrong\n",
              static_cast<long long>(checked), static_cast<long long>(mismatches), static_cast<long long>(ties_away),
              static_cast<long long>(rounding_wrong));
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(rounding_wrong, 0);
  EXPECT_GT(ties_away, 60000);  // every finite high half has one tie below it
}

TEST(SplitMaster, FloatFormsAgreeWithTheBitForms) {
  for (const float x : {0.0f, -0.0f, 1.0f, -3.14159265f, 1e-30f, -6.5e37f, 3.4028235e38f, 1.17549435e-38f,
                        1.0f + 1.0f / 256.0f}) {
    uint16_t high, low;
    split_master(x, high, low);
    const float back = join_split_master_float(high, low);
    EXPECT_EQ(std::memcmp(&back, &x, 4), 0) << x;
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    EXPECT_EQ(high, split_master_high(bits));
    EXPECT_EQ(low, split_master_low(bits));
  }
  // 1 + 2^-8 is a tie between bf16's 1 and 1 + 2^-7: away from zero gives the larger.
  uint16_t high, low;
  split_master(1.0f + 1.0f / 256.0f, high, low);
  EXPECT_EQ(bf16_bits_to_float(high), 1.0f + 1.0f / 128.0f);
  EXPECT_EQ(bf16_bits_to_float(float_to_bf16_bits(1.0f + 1.0f / 256.0f)), 1.0f);  // nearest even: 1
}

}  // namespace
}  // namespace deltamoe
