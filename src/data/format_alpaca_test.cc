// Alpaca lines (instruction / input / output, optional system) give the tokens and label mask of the
// same messages-form line; the query is "instruction\ninput" as ms-swift documents.
#include "data/format_test_util.h"

namespace deltamoe {
namespace {

using namespace format_test;

TEST(FormatAlpaca, InstructionAndInputJoinWithANewline) {
  expect_same_as_messages(
      R"({"system": "You translate.", "instruction": "Translate to French:", "input": "cat", "output": "chat"})",
      R"({"messages": [{"role": "system", "content": "You translate."}, {"role": "user", "content": "Translate to French:\ncat"},)"
      R"( {"role": "assistant", "content": "chat"}]})");
  // ms-swift: query = f'{instruction}\n{input}' when both are non-empty (docs/Customization/Custom-dataset.md).
  EXPECT_EQ(messages_of(R"({"instruction": "A", "input": "B", "output": "C"})")[0]["content"], "A\nB");
}

TEST(FormatAlpaca, AnEmptyInputLeavesTheInstruction) {
  expect_same_as_messages(R"({"instruction": "Name a colour.", "input": "", "output": "Blue."})",
                          R"({"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]})");
  expect_same_as_messages(R"({"instruction": "Name a colour.", "output": "Blue."})",
                          R"({"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]})");
}

TEST(FormatAlpaca, KeyOrderOfTheLineDoesNotMatter) {
  expect_same_as_messages(R"({"output": "Blue.", "input": "", "instruction": "Name a colour."})",
                          R"({"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]})");
}

TEST(FormatAlpaca, NonStringFieldsAreCountedSkips) {
  EXPECT_EQ(skip_of(R"({"instruction": 3, "input": "x", "output": "y"})").reason, SkipReason::kBadConversation);
}

}  // namespace
}  // namespace deltamoe
