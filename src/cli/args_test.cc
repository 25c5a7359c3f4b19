// Tests of the flag parser: values, defaults, required flags, unknown flags with suggestions.
#include <gtest/gtest.h>

#include <vector>

#include "cli/args.h"
#include "core/error.h"

namespace deltamoe {
namespace {

bool parse(ArgParser& parser, std::vector<const char*> args) {
  args.insert(args.begin(), {"deltamoe", "cmd"});
  return parser.parse(static_cast<int>(args.size()), const_cast<char**>(args.data()));
}

TEST(ArgParser, ParsesValuesFlagsAndDefaults) {
  ArgParser parser("cmd", "test");
  parser.add_required("out", "output");
  parser.add_option("seed", "seed", "0");
  parser.add_flag("verbose", "talk");
  parser.add_positional("dir", "directory", false);
  ASSERT_TRUE(parse(parser, {"--out", "x", "--seed=7", "--verbose", "mydir"}));
  EXPECT_EQ(parser.get("out"), "x");
  EXPECT_EQ(parser.get_int("seed"), 7);
  EXPECT_TRUE(parser.flag("verbose"));
  EXPECT_EQ(parser.get("dir"), "mydir");
}

TEST(ArgParser, RejectsUnknownFlagWithSuggestion) {
  ArgParser parser("cmd", "test");
  parser.add_option("seed", "seed", "0");
  try {
    parse(parser, {"--sede", "3"});
    FAIL() << "no error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("unknown flag --sede"), std::string::npos);
    EXPECT_NE(std::string(error.what()).find("did you mean --seed?"), std::string::npos);
  }
}

TEST(ArgParser, RejectsMissingRequiredAndBadNumbers) {
  ArgParser parser("cmd", "test");
  parser.add_required("out", "output");
  parser.add_option("seed", "seed", "0");
  EXPECT_THROW(parse(parser, {"--seed", "1"}), Error);
  ArgParser parser2("cmd", "test");
  parser2.add_option("seed", "seed", "0");
  ASSERT_TRUE(parse(parser2, {"--seed", "1x"}));
  EXPECT_THROW(parser2.get_int("seed"), Error);
}

}  // namespace
}  // namespace deltamoe
