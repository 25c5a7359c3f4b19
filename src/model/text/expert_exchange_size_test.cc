// expert_exchange_size: the receive capacity from a headroom, its bounds, the bytes growing with the
// rows, and the largest capacity within a budget.
#include "model/text/expert_exchange_size.h"

#include <gtest/gtest.h>

#include "core/error.h"

namespace deltamoe {
namespace {

TextConfig qwen35_text() { return model_config_preset("qwen3.5-35b-a3b").text; }

TEST(ExpertExchangeSize, CapacityFromHeadroom) {
  const TextConfig text = qwen35_text();
  const int64_t mean = expert_recv_mean_rows(text, 8192);
  EXPECT_EQ(mean, 8192 * 8);
  EXPECT_EQ(expert_recv_worst_rows(text, 8, 8192), 8 * mean);
  EXPECT_EQ(expert_recv_rows_for(text, 8, 8192, 0), 81920);  // auto's minimum: 1.25 x the mean
  EXPECT_EQ(expert_recv_rows_for(text, 8, 8192, 2), 2 * mean);
  EXPECT_EQ(expert_recv_rows_for(text, 8, 8192, 1.00001), mean + 1);  // rounded up
  EXPECT_EQ(expert_recv_rows_for(text, 2, 8192, 7), 2 * mean);        // never past the worst case
  EXPECT_THROW(expert_recv_rows_for(text, 8, 8192, 0.5), Error);
  EXPECT_EQ(expert_recv_capacity(text, 8, 8192, 0), 8 * mean);
  EXPECT_EQ(expert_recv_capacity(text, 8, 8192, 100), 100);
}

TEST(ExpertExchangeSize, BytesGrowWithTheRowsAndTheBudgetBoundsThem) {
  const TextConfig text = qwen35_text();
  const int64_t mean = expert_recv_mean_rows(text, 8192);
  const size_t at_min = expert_exchange_bytes(text, 8, 8192, mean);
  const size_t at_2x = expert_exchange_bytes(text, 8, 8192, 2 * mean);
  // Per received row at least its three bf16 row buffers of the hidden size and the experts' gate/up rows.
  EXPECT_GE(at_2x - at_min, static_cast<size_t>(mean) * (3 * 2048 * 2 + 2 * 512 * 2));
  const size_t budget = (at_min + at_2x) / 2;
  const int64_t rows = expert_recv_rows_within(text, 8, 8192, mean, budget);
  EXPECT_GT(rows, mean);
  EXPECT_LT(rows, 2 * mean);
  EXPECT_LE(expert_exchange_bytes(text, 8, 8192, rows), budget);
  EXPECT_GT(expert_exchange_bytes(text, 8, 8192, rows + 1), budget);
  // Room for everything: the worst case; no room: the minimum (the fit check then refuses the plan).
  EXPECT_EQ(expert_recv_rows_within(text, 8, 8192, mean, size_t{1} << 50), 8 * mean);
  EXPECT_EQ(expert_recv_rows_within(text, 8, 8192, mean, 0), mean);
}

}  // namespace
}  // namespace deltamoe
