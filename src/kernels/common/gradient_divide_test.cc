// The f32 form of the gradient's division (gradient_divide.h): for integer divisors below 2^24, the
// reciprocal-and-correction quotient is fl32(fl64(g) / d) bit for bit, over a whole binade of
// significands (at one exponent and at random ones) for a spread of divisors, with zeros keeping
// their sign and subnormal quotients taking the division; its unchecked form (no test, no division)
// gives the same bits wherever the quotient is at least 2^-125.
#include "kernels/common/gradient_divide.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace deltamoe {
namespace {

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// The CPU engine's definition.
float reference_quotient(float g, double d) { return static_cast<float>(static_cast<double>(g) / d); }

TEST(GradientDivide, IntegerDivisorQuotientIsTheCorrectlyRoundedOne) {
  std::mt19937_64 rng(2026);
  std::vector<uint32_t> divisors = {2, 3, 7, 4097, 8190, 12289, 1000003, (1u << 24) - 1};
  for (int i = 0; i < 4; ++i) divisors.push_back(1 + static_cast<uint32_t>(rng() % ((1u << 24) - 1)));
  int64_t checked = 0, wrong = 0, subnormal = 0;
  for (const uint32_t divisor : divisors) {
    const GradientDivisor d = gradient_divisor(divisor);
    ASSERT_EQ(d.kind, GradientDivide::f32);
    for (uint32_t mantissa = 0; mantissa < (1u << 23); ++mantissa) {
      // The binade [1, 2) and the same significand at a random exponent, either sign.
      const uint32_t exponent = 1 + static_cast<uint32_t>(rng() % 254);
      for (const uint32_t bits : {(127u << 23) | mantissa, (exponent << 23) | mantissa | (mantissa % 2 ? 1u << 31 : 0u)}) {
        const float g = float_of(bits);
        const float want = reference_quotient(g, divisor);
        subnormal += std::fabs(want) < std::numeric_limits<float>::min();
        wrong += bits_of(divide_by_integer(g, d.f32, d.reciprocal)) != bits_of(want);
        ++checked;
      }
    }
  }
  EXPECT_EQ(wrong, 0) << "of " << checked << " quotients";
  EXPECT_GT(subnormal, 0) << "the random exponents should reach subnormal quotients";
}

TEST(GradientDivide, ZerosInfinitiesAndTinyQuotients) {
  const GradientDivisor d = gradient_divisor(8190.0);
  for (const float g : {0.0f, -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::min(),
                        0x1.fffffep-110f, std::numeric_limits<float>::max()}) {
    EXPECT_EQ(bits_of(divide_by_integer(g, d.f32, d.reciprocal)), bits_of(reference_quotient(g, 8190.0))) << g;
  }
  EXPECT_TRUE(std::isnan(divide_by_integer(std::numeric_limits<float>::quiet_NaN(), d.f32, d.reciprocal)));
}

TEST(GradientDivide, KindFollowsTheDivisor) {
  EXPECT_EQ(gradient_divisor(1.0).kind, GradientDivide::none);
  const GradientDivisor tokens = gradient_divisor(4099.0);
  EXPECT_EQ(tokens.kind, GradientDivide::f32);
  EXPECT_EQ(tokens.f32, 4099.0f);
  EXPECT_EQ(tokens.reciprocal, static_cast<float>(1.0 / 4099.0));
  EXPECT_EQ(gradient_divisor(0.37).kind, GradientDivide::f64);
  EXPECT_EQ(gradient_divisor(16777216.0).kind, GradientDivide::f64);  // 2^24: fp32 no longer exact above
}

}  // namespace
}  // namespace deltamoe
