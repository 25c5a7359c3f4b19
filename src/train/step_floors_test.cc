// The step floors of `deltamoe bench` against hand-counted figures for one Qwen3.5-35B-A3B layer of
// each kind at 2 x 4,096 tokens on the H200's rates.
#include "train/step_floors.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <exception>
#include <vector>

#include "model/config.h"

namespace deltamoe {
namespace {

constexpr double kPeak = kH200PeakMatmulFlopsPerSecond, kBandwidth = kH200BytesPerSecond;

TEST(StepFloors, MatchHandCountsFor35BLayers) {
  const TextConfig c = model_config_preset("qwen3.5-35b-a3b").text;  // 30 GDN + 10 attention layers
  const std::vector<int32_t> cu = {0, 4096, 8192};
  const StepFloors f = micro_batch_floors(c, cu, true);
  const ComponentFloor adamw = adamw_floor(1000000000, DType::bf16);
  // MoE per layer: 256 x 2048 router + 8 x 3 x 512 x 2048 routed + 3 x 512 x 2048 shared + 2048
  // gate = 28,837,888 matmul parameters per token; 6 x that x 8,192 FLOPs. Weights: every expert
  // (805,306,368) at 2 + 2 + 2 bytes (bf16 gradients), shared 3,145,728 + gate 2,048 + router
  // 524,288 at 2 + 2 + 4.
  EXPECT_DOUBLE_EQ(f.moe.flops / 40.0, 6.0 * 28837888.0 * 8192.0);
  EXPECT_DOUBLE_EQ(f.moe.bytes / 40.0, 6.0 * 805306368.0 + 8.0 * 3672064.0);
  // GDN per layer: in_proj_qkv 8192 x 2048 + in_proj_z 4096 x 2048 + in_proj_b, _a 2 x 32 x 2048 +
  // out_proj 2048 x 4096 = 33,685,504.
  EXPECT_DOUBLE_EQ(f.gdn.flops / 30.0, 6.0 * 33685504.0 * 8192.0);
  EXPECT_DOUBLE_EQ(f.gdn.bytes / 30.0, 8.0 * 33685504.0);
  // Attention per layer: q (with gate) 2 x 16 x 256 x 2048 + k, v 2 x 2 x 256 x 2048 + o 2048 x 4096 =
  // 27,262,976, plus 6 x S^2 x 16 x 256 for each sequence of 4,096.
  EXPECT_DOUBLE_EQ(f.attention.flops / 10.0, 6.0 * 27262976.0 * 8192.0 + 2.0 * 6.0 * 4096.0 * 4096.0 * 16.0 * 256.0);
  // lm_head: 248,320 x 2048.
  EXPECT_DOUBLE_EQ(f.lm_head_loss.flops, 6.0 * 248320.0 * 2048.0 * 8192.0);
  // AdamW with bf16 moments: 22 bytes a trained parameter.
  EXPECT_DOUBLE_EQ(adamw.bytes, 22e9);
  EXPECT_DOUBLE_EQ(adamw.flops, 0.0);
  const double moe_ms = f.moe.ms(kPeak, kBandwidth) / 40.0, gdn_ms = f.gdn.ms(kPeak, kBandwidth) / 30.0;
  std::printf("35B floors per layer at 8,192 tokens (H200 rates): MoE %.3f ms, GDN %.3f ms, attention %.3f ms; "
              "lm_head %.2f ms; AdamW %.3f ms per 1e9 parameters\n",
              moe_ms, gdn_ms, f.attention.ms(kPeak, kBandwidth) / 10.0, f.lm_head_loss.ms(kPeak, kBandwidth),
              adamw.ms(kPeak, kBandwidth));
  // The MoE floor is its FLOPs (1.433 ms) rather than its weights' bytes (1.013 ms).
  EXPECT_NEAR(moe_ms, 1.4332, 1e-3);
  EXPECT_NEAR(gdn_ms, 1.6741, 1e-3);
  EXPECT_NEAR(adamw.ms(kPeak, kBandwidth), 22e9 / 4.8e12 * 1e3, 1e-9);
}

TEST(StepFloors, FrozenTextWritesNoGradientsAndFp32MomentsCostMore) {
  const TextConfig c = model_config_preset("qwen3.5-35b-a3b").text;
  const std::vector<int32_t> cu = {0, 8192};
  const StepFloors trained = micro_batch_floors(c, cu, true);
  const StepFloors frozen = micro_batch_floors(c, cu, false);
  // 4 bytes a weight instead of 6 (routed experts) and 8 (the rest).
  EXPECT_DOUBLE_EQ(frozen.moe.bytes, 4.0 * 808978432.0 * 40.0);
  EXPECT_DOUBLE_EQ(trained.moe.bytes, (6.0 * 805306368.0 + 8.0 * 3672064.0) * 40.0);
  EXPECT_DOUBLE_EQ(frozen.moe.flops, trained.moe.flops);
  EXPECT_DOUBLE_EQ(adamw_floor(1000, DType::f32).bytes, 30.0 * 1000.0);
  EXPECT_DOUBLE_EQ(adamw_floor(1000, DType::bf16, 600).bytes, 22.0 * 400.0 + 18.0 * 600.0);
  // One sequence of 8,192 has twice the attention pairs of two of 4,096.
  const StepFloors packed = micro_batch_floors(c, {0, 4096, 8192}, true);
  EXPECT_DOUBLE_EQ(trained.attention.flops - packed.attention.flops,
                   10.0 * 6.0 * 16.0 * 256.0 * (8192.0 * 8192.0 - 2.0 * 4096.0 * 4096.0));
  // bench sums micro-batches: two of 4,096 read the weights twice and have the packed batch's FLOPs.
  StepFloors two = micro_batch_floors(c, {0, 4096}, true);
  two += micro_batch_floors(c, {0, 4096}, true);
  EXPECT_DOUBLE_EQ(two.moe.flops, packed.moe.flops);
  EXPECT_DOUBLE_EQ(two.moe.bytes, 2.0 * packed.moe.bytes);
  EXPECT_DOUBLE_EQ(two.attention.flops, packed.attention.flops);
  // Only the supervised rows pass through lm_head: its FLOPs follow them, the rest does not.
  const StepFloors half = micro_batch_floors(c, {0, 4096, 8192}, true, 4096);
  EXPECT_DOUBLE_EQ(half.lm_head_loss.flops, packed.lm_head_loss.flops / 2.0);
  EXPECT_DOUBLE_EQ(half.lm_head_loss.bytes, packed.lm_head_loss.bytes);
  EXPECT_DOUBLE_EQ(half.moe.flops, packed.moe.flops);
  EXPECT_DOUBLE_EQ(micro_batch_floors(c, {0, 4096, 8192}, true, 8192).lm_head_loss.flops,
                   packed.lm_head_loss.flops);
  EXPECT_THROW(micro_batch_floors(c, {0, 4096}, true, 4097), std::exception);
  EXPECT_THROW(micro_batch_floors(c, {0}, true), std::exception);
  EXPECT_THROW(adamw_floor(-1, DType::f32), std::exception);
  EXPECT_THROW(adamw_floor(10, DType::f32, 11), std::exception);
}

TEST(StepFloors, MemoryBandwidthFromClockAndBusWidth) {
  // H100 SXM: 2,619 MHz HBM3 on 5,120 bits, 3.35 TB/s on its spec sheet; A800 80 GB: 1,593 MHz HBM2e,
  // 2.04 TB/s; H200: 6,144 bits, 4.8 TB/s at ~3.1 GHz.
  EXPECT_NEAR(memory_bytes_per_second(2619000, 5120), 3.352e12, 1e9);
  EXPECT_NEAR(memory_bytes_per_second(1593000, 5120), 2.039e12, 1e9);
  EXPECT_NEAR(memory_bytes_per_second(3125000, 6144), 4.8e12, 1e9);
  EXPECT_EQ(memory_bytes_per_second(0, 5120), 0.0);
  EXPECT_EQ(memory_bytes_per_second(2619000, -1), 0.0);
}

}  // namespace
}  // namespace deltamoe
