// reduce_into: the arithmetic of every (type, op), NaN handling, wrap-around and refusals.
#include "parallel/reduce.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"

namespace deltamoe {
namespace {

TEST(Reduce, F32SumIsPlainFloatAdditionInCallOrder) {
  // 1e8 + 1 + -1e8 depends on the order: ((1e8 + 1) - 1e8) = 0 in f32, (1e8 - 1e8) + 1 = 1.
  std::vector<float> acc{1e8f};
  const float one = 1.0f, minus = -1e8f;
  reduce_into(acc.data(), &one, 1, DType::f32, ReduceOp::sum);
  reduce_into(acc.data(), &minus, 1, DType::f32, ReduceOp::sum);
  EXPECT_EQ(acc[0], 0.0f);
  std::vector<float> other{1e8f};
  reduce_into(other.data(), &minus, 1, DType::f32, ReduceOp::sum);
  reduce_into(other.data(), &one, 1, DType::f32, ReduceOp::sum);
  EXPECT_EQ(other[0], 1.0f);
}

TEST(Reduce, Bf16SumRoundsEveryStep) {
  // 256 + 1 is not representable in bf16 (8 bits of mantissa): rounds back to 256 at each step,
  // so adding 1 twice leaves 256, while adding 2 at once gives 258.
  uint16_t acc = float_to_bf16_bits(256.0f);
  const uint16_t one = float_to_bf16_bits(1.0f);
  reduce_into(&acc, &one, 1, DType::bf16, ReduceOp::sum);
  reduce_into(&acc, &one, 1, DType::bf16, ReduceOp::sum);
  EXPECT_EQ(bf16_bits_to_float(acc), 256.0f);
  const uint16_t two = float_to_bf16_bits(2.0f);
  uint16_t acc2 = float_to_bf16_bits(256.0f);
  reduce_into(&acc2, &two, 1, DType::bf16, ReduceOp::sum);
  EXPECT_EQ(bf16_bits_to_float(acc2), 258.0f);
}

TEST(Reduce, F16SumRoundsToHalf) {
  uint16_t acc = float_to_f16_bits(2048.0f);
  const uint16_t one = float_to_f16_bits(1.0f);
  reduce_into(&acc, &one, 1, DType::f16, ReduceOp::sum);
  EXPECT_EQ(f16_bits_to_float(acc), 2048.0f);  // 2049 is not a half; ties to even
}

TEST(Reduce, MaxPropagatesNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> acc{1.0f, nan, 3.0f};
  const std::vector<float> x{nan, 5.0f, 2.0f};
  reduce_into(acc.data(), x.data(), 3, DType::f32, ReduceOp::max);
  EXPECT_TRUE(std::isnan(acc[0]));
  EXPECT_TRUE(std::isnan(acc[1]));
  EXPECT_EQ(acc[2], 3.0f);
  uint16_t half_acc = float_to_bf16_bits(1.0f);
  const uint16_t half_nan = float_to_bf16_bits(nan);
  reduce_into(&half_acc, &half_nan, 1, DType::bf16, ReduceOp::max);
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(half_acc)));
}

TEST(Reduce, IntegerSumWrapsAndMaxIsSigned) {
  int64_t acc = std::numeric_limits<int64_t>::max();
  const int64_t one = 1;
  reduce_into(&acc, &one, 1, DType::i64, ReduceOp::sum);
  EXPECT_EQ(acc, std::numeric_limits<int64_t>::min());
  int32_t a = -5;
  const int32_t b = -7;
  reduce_into(&a, &b, 1, DType::i32, ReduceOp::max);
  EXPECT_EQ(a, -5);
  double d = 0.1;
  const double e = 0.2;
  reduce_into(&d, &e, 1, DType::f64, ReduceOp::sum);
  EXPECT_EQ(d, 0.1 + 0.2);
}

TEST(Reduce, BoolMaxIsOrAndSumIsRefused) {
  uint8_t acc[3] = {0, 1, 0};
  const uint8_t x[3] = {0, 0, 1};
  reduce_into(acc, x, 3, DType::boolean, ReduceOp::max);
  EXPECT_EQ(acc[0], 0);
  EXPECT_EQ(acc[1], 1);
  EXPECT_EQ(acc[2], 1);
  EXPECT_FALSE(reduce_supported(DType::boolean, ReduceOp::sum));
  EXPECT_FALSE(reduce_supported(DType::u8, ReduceOp::sum));
  try {
    reduce_into(acc, x, 3, DType::u8, ReduceOp::sum);
    FAIL() << "sum of u8 was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("not defined for u8"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace deltamoe
