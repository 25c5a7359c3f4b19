// The kept-intermediates rule (kept_intermediates.h): both when they fit with the margin, else the
// single choice that saves more, else the other, else none; candidates with no layers are never
// tried; the margin is beyond the plan, not within it.
#include "train/kept_intermediates.h"

#include <gtest/gtest.h>

#include <vector>

namespace deltamoe {
namespace {

constexpr size_t kGiB = size_t{1} << 30;

// A plan of `base` bytes plus `rows` and `gdn` bytes for what it keeps; records what was tried.
struct FakePlan {
  size_t base, rows, gdn;
  std::vector<KeptIntermediates> tried;
  size_t operator()(const KeptIntermediates& kept) {
    tried.push_back(kept);
    return base + (kept.expert_rows ? rows : 0) + (kept.gdn_forward ? gdn : 0);
  }
};

KeptIntermediates choose(FakePlan& plan, int64_t rows_layers, int64_t gdn_layers, size_t available) {
  return choose_kept_intermediates(rows_layers, gdn_layers, available,
                                   [&](const KeptIntermediates& kept) { return plan(kept); });
}

TEST(KeptIntermediates, BothWhenTheyFitWithTheMargin) {
  FakePlan plan{10 * kGiB, 5 * kGiB, 9 * kGiB, {}};
  const KeptIntermediates kept = choose(plan, 40, 30, 26 * kGiB);  // 24 + 2: exactly the margin
  EXPECT_TRUE(kept.expert_rows && kept.gdn_forward);
  ASSERT_EQ(plan.tried.size(), 1u);
}

TEST(KeptIntermediates, TheSingleChoiceThatSavesMoreComesFirst) {
  // 40 kept layers of rows save 22 ms, 30 GDN layers 24 ms: the GDN forward is tried first.
  FakePlan plan{10 * kGiB, 5 * kGiB, 9 * kGiB, {}};
  KeptIntermediates kept = choose(plan, 40, 30, 22 * kGiB);  // both: 24 + 2 > 22; gdn: 19 + 2 <= 22
  EXPECT_TRUE(!kept.expert_rows && kept.gdn_forward);
  ASSERT_EQ(plan.tried.size(), 2u);
  EXPECT_TRUE(plan.tried[1].gdn_forward && !plan.tried[1].expert_rows);
  // With few GDN layers the rows save more and go first; if they do not fit, the GDN forward.
  FakePlan small_gdn{10 * kGiB, 5 * kGiB, 1 * kGiB, {}};
  kept = choose(small_gdn, 40, 3, 14 * kGiB);  // both 16 + 2 > 14, rows 15 + 2 > 14, gdn 11 + 2 <= 14
  EXPECT_TRUE(!kept.expert_rows && kept.gdn_forward);
  ASSERT_EQ(small_gdn.tried.size(), 3u);
  EXPECT_TRUE(small_gdn.tried[1].expert_rows && !small_gdn.tried[1].gdn_forward);
}

TEST(KeptIntermediates, NothingWhenNothingFitsOrNothingApplies) {
  FakePlan tight{10 * kGiB, 5 * kGiB, 9 * kGiB, {}};
  EXPECT_FALSE(choose(tight, 40, 30, 11 * kGiB).expert_rows);
  EXPECT_EQ(tight.tried.size(), 3u);
  // Each single choice fits the device but leaves 1.5 GiB, less than the margin.
  FakePlan short_of_margin{10 * kGiB, 5 * kGiB, 5 * kGiB, {}};
  const KeptIntermediates none_kept = choose(short_of_margin, 40, 30, 16 * kGiB + kGiB / 2);
  EXPECT_FALSE(none_kept.expert_rows || none_kept.gdn_forward) << "kept within the 2 GiB margin";
  EXPECT_EQ(short_of_margin.tried.size(), 3u);
  // Exactly the margin is enough.
  FakePlan at_margin{10 * kGiB, 5 * kGiB, 5 * kGiB, {}};
  EXPECT_TRUE(choose(at_margin, 40, 30, 17 * kGiB).gdn_forward);
  FakePlan none{10 * kGiB, 5 * kGiB, 9 * kGiB, {}};
  const KeptIntermediates kept = choose(none, 0, 0, 100 * kGiB);  // no candidate applies
  EXPECT_FALSE(kept.expert_rows || kept.gdn_forward);
  EXPECT_TRUE(none.tried.empty());
  // Expert parallelism: the rows are no candidate, the GDN forward alone is tried.
  FakePlan expert_parallel{10 * kGiB, 5 * kGiB, 9 * kGiB, {}};
  const KeptIntermediates gdn_only = choose(expert_parallel, 0, 30, 100 * kGiB);
  EXPECT_TRUE(!gdn_only.expert_rows && gdn_only.gdn_forward);
  ASSERT_EQ(expert_parallel.tried.size(), 1u);
  // Rows only where the model has no GDN layer.
  FakePlan rows_only{10 * kGiB, 5 * kGiB, 9 * kGiB, {}};
  const KeptIntermediates rows = choose(rows_only, 8, 0, 100 * kGiB);
  EXPECT_TRUE(rows.expert_rows && !rows.gdn_forward);
  // A plan above the device (unsigned arithmetic must not wrap into "fits").
  FakePlan over{10 * kGiB, 5 * kGiB, 9 * kGiB, {}};
  EXPECT_FALSE(choose(over, 40, 30, 5 * kGiB).gdn_forward);
}

}  // namespace
}  // namespace deltamoe
