// Checks the FLOP counting of `deltamoe bench` against hand-counted figures for Qwen3.5-35B-A3B
// (docs/performance.md, "How FLOPs, MFU and floors are counted": 2.95 B matmul parameters per token,
// 18.7 GFLOP per token at S = 4096).
#include "train/model_flops.h"

#include <gtest/gtest.h>

#include <cstdio>

namespace deltamoe {

TEST(BenchFlops, MatchesBaselinesArithmeticFor35B) {
  TextConfig c = model_config_preset("qwen3.5-35b-a3b").text;
  const double params = static_cast<double>(matmul_params_per_token(c));
  std::printf("35B-A3B matmul params per token: %.4f B (hand count: 2.95 B)\n", params / 1e9);
  EXPECT_NEAR(params / 1e9, 2.95, 0.03);
  // 18.7 GFLOP per token at S = 4096 (6 x 2.95 B + 10 attention layers x 6 x 4096 x 16 x 256).
  const std::vector<int32_t> cu = {0, 4096, 8192};
  const double per_token = training_step_flops(c, cu) / 8192.0;
  std::printf("training GFLOP per token at S=4096: %.3f (hand count: 18.7)\n", per_token / 1e9);
  EXPECT_NEAR(per_token / 1e9, 18.7, 0.15);
}

TEST(BenchFlops, AttentionTermGrowsWithSequenceLength) {
  TextConfig c = model_config_preset("qwen3.5-35b-a3b").text;
  const double packed_short = training_step_flops(c, {0, 1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192});
  const double one_long = training_step_flops(c, {0, 8192});
  const double expected_gap = 10.0 * 6.0 * 16 * 256 * (8192.0 * 8192.0 - 8.0 * 1024.0 * 1024.0);
  std::printf("attention gap one 8192 vs 8 x 1024: %.4g FLOP (expected %.4g)\n", one_long - packed_short, expected_gap);
  EXPECT_NEAR((one_long - packed_short) / expected_gap, 1.0, 1e-9);
}

}  // namespace deltamoe
