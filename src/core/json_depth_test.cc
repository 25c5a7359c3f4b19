// json_nesting_depth: counts brackets outside strings, stops early past the bound.
#include <gtest/gtest.h>

#include <string>

#include "core/json_depth.h"

namespace deltamoe {
namespace {

TEST(JsonDepth, CountsNestingOutsideStrings) {
  EXPECT_EQ(json_nesting_depth("42"), 0);
  EXPECT_EQ(json_nesting_depth("{}"), 1);
  EXPECT_EQ(json_nesting_depth(R"({"a": [1, {"b": [2]}], "c": {}})"), 4);
  // Brackets inside strings, also after escaped quotes and backslashes, do not count.
  EXPECT_EQ(json_nesting_depth(R"({"a": "[[[{{{", "b": "\"[[[", "c": "\\"})"), 1);
  EXPECT_EQ(json_nesting_depth(R"(["\\\"[[["])"), 1);
}

TEST(JsonDepth, StopsAboveTheBound) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_GT(json_nesting_depth(deep), kMaxJsonDepth);
  EXPECT_EQ(json_nesting_depth(deep, 10), 11);  // stopped at the first level past the bound
  EXPECT_EQ(json_nesting_depth(deep, 1 << 20), 100000);
}

}  // namespace
}  // namespace deltamoe
