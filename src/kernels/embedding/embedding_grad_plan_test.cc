// embedding_grad_plan: every in-range token once, grouped by ascending id, positions ascending
// within an id; out-of-range ids left out.
#include "kernels/embedding/embedding_grad_plan.h"

#include <gtest/gtest.h>

namespace deltamoe {
namespace {

TEST(EmbeddingGradPlan, GroupsTokensByIdInPositionOrder) {
  const std::vector<int64_t> ids = {5, 2, 5, -1, 9, 2, 5, 12, 0};
  const EmbeddingGradPlan plan = embedding_grad_plan(ids.data(), static_cast<int64_t>(ids.size()), 10);
  EXPECT_EQ(plan.segment_ids, (std::vector<int64_t>{0, 2, 5, 9}));
  EXPECT_EQ(plan.segment_offsets, (std::vector<int32_t>{0, 1, 3, 6, 7}));
  EXPECT_EQ(plan.sorted_tokens, (std::vector<int32_t>{8, 1, 5, 0, 2, 6, 4}));
}

TEST(EmbeddingGradPlan, EmptyBatch) {
  const EmbeddingGradPlan plan = embedding_grad_plan(nullptr, 0, 10);
  EXPECT_TRUE(plan.sorted_tokens.empty());
  EXPECT_EQ(plan.segment_offsets, (std::vector<int32_t>{0}));
}

}  // namespace
}  // namespace deltamoe
