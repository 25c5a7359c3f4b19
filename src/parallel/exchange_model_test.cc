// The exchange model against the design's own arithmetic (distributed-design.md §2.3): 8 ranks of
// 8,192 tokens, top-8, hidden 2,048, 40 layers, four exchanges per layer move 37.6 GB per
// micro-batch, 107 ms at 350 GB/s; ZeRO-2's dense traffic and the step prediction add up.
#include "parallel/exchange_model.h"

#include <gtest/gtest.h>

#include "core/error.h"

namespace deltamoe {
namespace {

TEST(ExchangeModel, ReproducesTheDesignsA2aBudget) {
  ExchangeModelInput in;
  in.exchanges_per_layer = 4;  // the design's count (no backward re-dispatch)
  const ExchangeModel model = model_exchange(in);
  EXPECT_NEAR(model.exchange_bytes / 1e9, 37.6, 0.1);
  EXPECT_NEAR(model.exchange_seconds * 1e3, 107.0, 1.0);
  in.exchanges_per_layer = 5;  // the engine's schedule
  EXPECT_NEAR(model_exchange(in).exchange_bytes / model.exchange_bytes, 5.0 / 4.0, 1e-3);
}

TEST(ExchangeModel, DenseTrafficAndTheStepAddUp) {
  ExchangeModelInput in;
  in.dense_trained_elements = 2.9e9;
  in.micro_batches = 2;
  in.imbalance = 1.1;
  const ExchangeModel model = model_exchange(in);
  EXPECT_NEAR(model.reduce_scatter_bytes, 2.9e9 * 4 * 7 / 8, 1e3);
  EXPECT_NEAR(model.all_gather_bytes, 2.9e9 * 2 * 7 / 8, 1e3);
  const double step = model.predicted_step_seconds(2.0, 2);
  EXPECT_NEAR(step, 2.0 * 1.1 + 2 * model.exchange_seconds + model.reduce_scatter_seconds + model.all_gather_seconds,
              1e-12);
  EXPECT_GT(model.exchange_seconds, model_exchange(ExchangeModelInput{}).exchange_seconds);  // imbalance counts
  // One rank exchanges nothing.
  in.ranks = 1;
  EXPECT_EQ(model_exchange(in).exchange_bytes, 0.0);
  EXPECT_EQ(model_exchange(in).reduce_scatter_bytes, 0.0);
  in.imbalance = 0.5;
  EXPECT_THROW(model_exchange(in), Error);
}

}  // namespace
}  // namespace deltamoe
