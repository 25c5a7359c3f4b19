// query / response / history lines (and the other key names ms-swift maps to them: prompt,
// question, answer, completion, ...) give the tokens and label mask of the same messages-form line.
#include "data/format_test_util.h"

namespace deltamoe {
namespace {

using namespace format_test;

TEST(FormatQueryResponse, HistoryTurnsComeFirst) {
  expect_same_as_messages(
      R"({"system": "Be brief.", "query": "Bye?", "response": "Goodbye.", "history": [["Hi?", "Hello."]]})",
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},)"
      R"( {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"},)"
      R"( {"role": "assistant", "content": "Goodbye."}]})");
}

TEST(FormatQueryResponse, OtherKeyNamesMeanTheSame) {
  const char* const want = R"({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]})";
  for (const char* line : {R"({"prompt": "Q", "completion": "A"})", R"({"question": "Q", "answer": "A"})",
                           R"({"problem": "Q", "solution": "A"})", R"({"input": "Q", "output": "A"})",
                           R"({"query": "Q", "response": ["A", "B"]})", R"({"system_prompt": null, "query": "Q", "target": "A"})"}) {
    SCOPED_TRACE(line);
    expect_same_as_messages(line, want);
  }
  expect_same_as_messages(R"({"system_prompt": "S", "query": "Q", "response": "A"})",
                          R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]})");
}

TEST(FormatQueryResponse, BadHistoryIsACountedSkip) {
  EXPECT_EQ(skip_of(R"({"query": "Q", "response": "A", "history": [["only one"]]})").reason, SkipReason::kBadConversation);
  EXPECT_EQ(skip_of(R"({"query": "Q", "response": "A", "history": "[['q', 'a']]"})").reason, SkipReason::kBadConversation);
  EXPECT_EQ(skip_of(R"({"nothing": "here"})").reason, SkipReason::kBadConversation);
}

}  // namespace
}  // namespace deltamoe
