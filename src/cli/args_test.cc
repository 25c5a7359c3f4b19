// Tests of the flag parser: values, defaults, required flags, unknown flags with suggestions.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "cli/args.h"
#include "core/error.h"
#include "testing/error_of.h"

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

// "--lr --max_steps 2" must name the flag without a value, not report "unexpected argument '2'" (far
// from the real mistake).
TEST(ArgParser, AFlagWhereAValueShouldBeSaysWhichValueIsMissing) {
  ArgParser parser("cmd", "test");
  parser.add_option("lr", "learning rate", "1");
  parser.add_option("max_steps", "steps", "1");
  const std::string message = error_of([&] { parse(parser, {"--lr", "--max_steps", "2"}); });
  EXPECT_NE(message.find("flag --lr needs a value, but the next argument is the flag --max_steps"), std::string::npos)
      << message;
  ArgParser inline_value("cmd", "test");
  inline_value.add_option("lr", "learning rate", "1");
  ASSERT_TRUE(parse(inline_value, {"--lr=--x"}));  // the escape hatch for a value starting with --
  EXPECT_EQ(inline_value.get("lr"), "--x");
}

TEST(ArgParser, NonFiniteNumbersAreRefused) {
  for (const char* text : {"nan", "NaN", "inf", "-inf", "1e999"}) {
    ArgParser parser("cmd", "test");
    parser.add_option("max_grad_norm", "clip", "1");
    ASSERT_TRUE(parse(parser, {"--max_grad_norm", text}));
    const std::string message = error_of([&] { parser.get_double("max_grad_norm"); });
    EXPECT_NE(message.find("--max_grad_norm must be a finite number"), std::string::npos) << text << ": " << message;
  }
}

}  // namespace
}  // namespace deltamoe
