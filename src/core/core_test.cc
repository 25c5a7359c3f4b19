// Tests of core: bf16/f16 rounding, shapes, arenas, RNG determinism, CHECK messages.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/arena.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace deltamoe {
namespace {

TEST(Bf16, RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties go to the even mantissa.
  EXPECT_EQ(float_to_bf16_bits(1.0f + 1.0f / 256), 0x3F80);
  // 1 + 3*2^-8 is halfway between 1.0078125 (odd) and 1.015625 (even): rounds up.
  EXPECT_EQ(float_to_bf16_bits(1.0f + 3.0f / 256), 0x3F82);
  // Just above the halfway point rounds up.
  EXPECT_EQ(float_to_bf16_bits(std::nextafter(1.0f + 1.0f / 256, 2.0f)), 0x3F81);
  EXPECT_EQ(float_to_bf16_bits(-2.0f), 0xC000);
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::quiet_NaN()), 0x7FC0);
  // The largest finite float overflows to infinity under round-to-nearest-even, as in torch.
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(bf16_bits_to_float(0x3F80), 1.0f);
}

TEST(F16, RoundTripsAndRounds) {
  EXPECT_EQ(float_to_f16_bits(1.0f), 0x3C00);
  EXPECT_EQ(float_to_f16_bits(-2.5f), 0xC100);
  EXPECT_EQ(float_to_f16_bits(65504.0f), 0x7BFF);
  EXPECT_EQ(float_to_f16_bits(1e6f), 0x7C00);
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_f16_bits(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie to even
  for (uint32_t bits = 0; bits < 0x7C00; bits += 7) {
    EXPECT_EQ(float_to_f16_bits(f16_bits_to_float(static_cast<uint16_t>(bits))), bits);
  }
}

TEST(Shape, NumelStridesAndStr) {
  Shape shape{2, 3, 4};
  EXPECT_EQ(shape.numel(), 24);
  EXPECT_EQ(contiguous_strides(shape), (Shape{12, 4, 1}));
  EXPECT_EQ(shape.str(), "[2, 3, 4]");
  EXPECT_EQ(shape[-1], 4);
  EXPECT_THROW(shape[3], Error);
}

TEST(HostTensor, ConvertsDtypes) {
  HostTensor values = HostTensor::from_f32({1.0f, 1.0f + 1.0f / 256, -3.0f}, Shape{3});
  HostTensor as_bf16 = values.to_dtype(DType::bf16);
  EXPECT_EQ(as_bf16.as<bf16>()[1].bits, 0x3F80);
  HostTensor back = as_bf16.to_f32();
  EXPECT_EQ(back.as<float>()[2], -3.0f);
  EXPECT_THROW(values.as<int32_t>(), Error);
}

// Small tensors come from the heap, large ones (64 MiB and up) from their own mapping: either way
// zeroed, aligned, writable to the last element, and freed with the last copy.
TEST(HostTensor, SmallAndLargeAreZeroedAlignedAndWritable) {
  for (const int64_t count : {int64_t{3}, int64_t{16} << 20, (int64_t{16} << 20) + 5, int64_t{40} << 20}) {
    for (int round = 0; round < 2; ++round) {  // the second takes memory the first gave back
      HostTensor tensor(DType::f32, Shape{count});
      const float* values = tensor.as<float>();
      EXPECT_EQ(reinterpret_cast<uintptr_t>(values) % 64, 0u) << count;
      float largest = 0.0f;
      for (int64_t i = 0; i < count; i += 4093) largest = std::max(largest, std::fabs(values[i]));
      EXPECT_EQ(largest, 0.0f) << count;
      EXPECT_EQ(values[count - 1], 0.0f) << count;
      tensor.as<float>()[count - 1] = 5.0f;
      const HostTensor copy = tensor;  // shares the buffer
      tensor = HostTensor();
      EXPECT_EQ(copy.as<float>()[count - 1], 5.0f) << count;
    }
  }
}

TEST(Arena, AlignsAndReportsOverflow) {
  HostArena arena(1024, "test arena");
  void* a = arena.allocate(10, 64);
  void* b = arena.allocate(10, 64);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
  EXPECT_EQ(static_cast<char*>(b) - static_cast<char*>(a), 64);
  try {
    arena.allocate(2048);
    FAIL() << "no error for an overfull arena";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("test arena: out of space"), std::string::npos);
  }
  arena.reset();
  EXPECT_EQ(arena.used(), 0u);
  EXPECT_EQ(arena.high_water(), 74u);
}

TEST(Rng, DeterministicAndSeekable) {
  Rng a(42), b(42), c(43);
  uint32_t first = a.next_u32();
  EXPECT_EQ(first, b.next_u32());
  EXPECT_NE(first, c.next_u32());
  for (int i = 0; i < 5; ++i) a.next_u32();
  uint64_t position = a.position();
  uint32_t expected = a.next_u32();
  Rng d(42);
  d.seek(position);
  EXPECT_EQ(d.next_u32(), expected);
  // Mean and variance of normals are close to 0 and 1.
  Rng e(7);
  double sum = 0, sum_sq = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    double x = e.normal();
    sum += x;
    sum_sq += x * x;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sum_sq / n, 1.0, 0.01);
}

TEST(Check, MessageHasLocationAndValues) {
  try {
    CHECK(1 + 1 == 3, "value was ", 2);
    FAIL() << "CHECK did not throw";
  } catch (const Error& error) {
    std::string message = error.what();
    EXPECT_NE(message.find("src/core/core_test.cc:"), std::string::npos) << message;
    EXPECT_NE(message.find("value was 2"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace deltamoe
