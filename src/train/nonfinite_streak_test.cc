// NonFiniteStreak: counts NaN/Inf steps in a row, resets on a finite one, stops at the limit.
#include <gtest/gtest.h>

#include <limits>

#include "core/error.h"
#include "train/nonfinite_streak.h"

namespace deltamoe {
namespace {

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(NonFiniteStreak, StopsAfterLimitStepsInARow) {
  NonFiniteStreak streak(3);
  EXPECT_FALSE(streak.record(1, 2.5, 1.0));
  EXPECT_FALSE(streak.in_streak());
  EXPECT_FALSE(streak.record(2, kNan, 1.0));  // loss
  EXPECT_TRUE(streak.in_streak());
  EXPECT_FALSE(streak.record(3, 2.0, kInf));  // gradient norm
  EXPECT_EQ(streak.length(), 2);
  EXPECT_TRUE(streak.record(4, kNan, kNan));
  const std::string message = streak.stop_message();
  EXPECT_NE(message.find("steps 2..4 (3 in a row, --max_nonfinite_steps 3)"), std::string::npos) << message;
  EXPECT_NE(message.find("without saving"), std::string::npos) << message;
}

TEST(NonFiniteStreak, AFiniteStepEndsTheStreak) {
  NonFiniteStreak streak(2);
  EXPECT_FALSE(streak.record(1, kNan, kNan));
  EXPECT_FALSE(streak.record(2, 1.0, 0.5));
  EXPECT_FALSE(streak.in_streak());
  EXPECT_FALSE(streak.record(3, kNan, kNan));  // a new streak of one
  EXPECT_TRUE(streak.record(4, -kInf, 1.0));
}

TEST(NonFiniteStreak, ZeroNeverStopsButStillTracksTheStreak) {
  NonFiniteStreak streak(0);
  for (int64_t step = 1; step <= 100; ++step) EXPECT_FALSE(streak.record(step, kNan, kNan));
  EXPECT_EQ(streak.length(), 100);
  EXPECT_NE(streak.refused_save_message().find("not saving at step 100"), std::string::npos);
  EXPECT_THROW(NonFiniteStreak(-1), Error);
}

}  // namespace
}  // namespace deltamoe
