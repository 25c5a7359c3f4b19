// checkpoint_with_state's rounding: a bf16 checkpoint holds each master rounded as the engines
// round their working weights (the master's high half, ties away from zero), so the saved model
// computes with the weights training computed with; an fp16 one is rounded to nearest even.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "checkpoint/random_init.h"
#include "model/config.h"
#include "optim/host_train_state.h"
#include "train/trainable_params.h"

namespace deltamoe {
namespace {

// The first trained tensor's first elements as saved, in their on-disk bits.
std::vector<uint16_t> saved_bits(DType dtype, const std::vector<float>& masters) {
  ModelCheckpoint base = random_init_checkpoint(model_config_preset("tiny"), 7, DType::bf16);
  const ParamLayout layout = trainable_layout(base, FreezeOptions{false, false, false});
  // The tensor as stored on disk in `dtype` (random init writes bf16 or f32 only).
  StoredTensor& stored = base.params.at(layout.entry(0).name);
  stored = StoredTensor::from_host(stored.to_host().to_dtype(dtype));
  HostTrainState state(layout, AdamWConfig{});
  const ParamEntry& entry = layout.entry(0);
  EXPECT_GE(entry.numel, static_cast<int64_t>(masters.size()));
  state.write_state(StateKind::master, 0, 0, static_cast<int64_t>(masters.size()), masters.data());
  const ModelCheckpoint saved = checkpoint_with_state(base, state);
  const HostTensor tensor = saved.params.at(entry.name).to_host();
  EXPECT_EQ(tensor.dtype(), dtype);
  std::vector<uint16_t> bits(masters.size());
  std::memcpy(bits.data(), tensor.data(), bits.size() * 2);
  return bits;
}

TEST(CheckpointWithState, Bf16RoundsTiesAwayFromZeroAsTheWorkingWeights) {
  const std::vector<float> masters = {
      std::bit_cast<float>(0x3F808000u),  // halfway between 0x3F80 and 0x3F81: away from zero (nearest even: 0x3F80)
      std::bit_cast<float>(0xBF808000u),  // the same, negative
      std::bit_cast<float>(0x3F818000u),  // halfway above an odd half: 0x3F82 either way
      std::bit_cast<float>(0x3F807FFFu),  // below halfway: 0x3F80
      std::bit_cast<float>(0x3F80C000u),  // above halfway: 0x3F81
      1.0f,
      std::nanf(""),
      std::bit_cast<float>(0x7FFFFFFFu),  // a NaN whose high half would carry into -0
      INFINITY,
  };
  const std::vector<uint16_t> got = saved_bits(DType::bf16, masters);
  const std::vector<uint16_t> want = {0x3F81, 0xBF81, 0x3F82, 0x3F80, 0x3F81, 0x3F80};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << "element " << i;
  for (size_t i = 6; i < 8; ++i) EXPECT_TRUE((got[i] & 0x7F80) == 0x7F80 && (got[i] & 0x7F) != 0) << "NaN " << i;
  EXPECT_EQ(got[8], 0x7F80);
}

TEST(CheckpointWithState, Fp16RoundsToNearestEven) {
  // 1 + 2^-11 is halfway between fp16's 1 (0x3C00) and the next value (0x3C01): to the even 0x3C00.
  const std::vector<uint16_t> got =
      saved_bits(DType::f16, {1.0f + std::ldexp(1.0f, -11), 1.0f + 3 * std::ldexp(1.0f, -11)});
  EXPECT_EQ(got[0], 0x3C00);
  EXPECT_EQ(got[1], 0x3C02);
}

}  // namespace
}  // namespace deltamoe
