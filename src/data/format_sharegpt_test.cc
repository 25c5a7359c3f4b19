// ShareGPT lines ("conversations" of {"from", "value"} turns; ms-swift's "conversation" of
// {"human", "assistant"} pairs) give the tokens and label mask of the same messages-form line.
#include "data/format_test_util.h"

namespace deltamoe {
namespace {

using namespace format_test;

const char* const kMessages =
    R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},)"
    R"( {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"},)"
    R"( {"role": "assistant", "content": "Goodbye."}]})";

TEST(FormatShareGpt, FromValueTurnsMatchMessages) {
  expect_same_as_messages(
      R"({"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},)"
      R"( {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "Bye?"}, {"from": "gpt", "value": "Goodbye."}]})",
      kMessages);
}

TEST(FormatShareGpt, TopLevelSystemGoesFirst) {
  expect_same_as_messages(
      R"({"system": "Be brief.", "conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."},)"
      R"( {"from": "user", "value": "Bye?"}, {"from": "assistant", "value": "Goodbye."}]})",
      kMessages);
  // A conversation with its own system message keeps it (ms-swift's rule): the top-level one is not added.
  const auto messages = messages_of(R"({"system": "Top.", "conversations": [{"from": "system", "value": "Own."},)"
                                    R"( {"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]})");
  ASSERT_EQ(messages.size(), 3u);
  EXPECT_EQ(messages[0]["content"], "Own.");
}

TEST(FormatShareGpt, SwiftPairsMatchMessages) {
  // ms-swift's documented ShareGPT form: {"system", "conversation": [{"human", "assistant"}]}.
  expect_same_as_messages(
      R"({"system": "Be brief.", "conversation": [{"human": "Hi?", "assistant": "Hello."},)"
      R"( {"human": "Bye?", "assistant": "Goodbye."}]})",
      kMessages);
}

TEST(FormatShareGpt, ObservationAndFunctionCallRolesBecomeToolTurns) {
  expect_same_as_messages(
      R"({"conversations": [{"from": "human", "value": "Weather?"}, {"from": "function_call", "value": "{\"name\": \"w\", \"arguments\": {\"city\": \"Oslo\"}}"},)"
      R"( {"from": "observation", "value": "Rain."}, {"from": "gpt", "value": "It rains."}]})",
      R"({"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"city": "Oslo"}}}]},)"
      R"( {"role": "tool", "content": "Rain."}, {"role": "assistant", "content": "It rains."}]})");
}

TEST(FormatShareGpt, BadTurnsAreCountedSkips) {
  EXPECT_EQ(skip_of(R"({"conversations": [{"speaker": "x"}]})").reason, SkipReason::kBadConversation);
  EXPECT_EQ(skip_of(R"({"conversations": []})").reason, SkipReason::kBadConversation);
  EXPECT_EQ(skip_of(R"({"conversations": [{"from": "alien", "value": "x"}]})").reason, SkipReason::kBadConversation);
}

}  // namespace
}  // namespace deltamoe
