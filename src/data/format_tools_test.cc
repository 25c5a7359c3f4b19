// Agent lines: "tools" (a list or a JSON string), ms-swift's tool_call / tool_response roles, and
// OpenAI tool_calls whose arguments are a JSON string give the tokens and label mask of the
// messages form with argument objects; key order is kept wherever JSON is read or written.
#include "data/format_test_util.h"

namespace deltamoe {
namespace {

using namespace format_test;

const char* const kTools =
    R"([{"type": "function", "function": {"name": "aqi", "description": "Air quality.", "parameters": {"type": "object",)"
    R"( "properties": {"zone": {"type": "string"}, "city": {"type": "string"}}, "required": ["city"]}}}])";

std::string messages_form() {
  return str_cat(R"({"tools": )", kTools, R"(, "messages": [{"role": "user", "content": "Air in Oslo and Rome?"},)",
                 R"( {"role": "assistant", "content": "Checking.", "tool_calls": [)",
                 R"({"type": "function", "function": {"name": "aqi", "arguments": {"zone": "z1", "city": "Oslo"}}},)",
                 R"( {"type": "function", "function": {"name": "aqi", "arguments": {"zone": "z2", "city": "Rome"}}}]},)",
                 R"( {"role": "tool", "content": "10"}, {"role": "tool", "content": "72"},)",
                 R"( {"role": "assistant", "content": "Oslo 10, Rome 72."}]})");
}

TEST(FormatTools, SwiftToolCallRolesMatchOpenAiToolCalls) {
  const std::string tools_string = nlohmann::json(std::string(kTools)).dump();  // "tools" stored as a JSON string
  expect_same_as_messages(
      str_cat(R"({"tools": )", tools_string, R"(, "messages": [{"role": "user", "content": "Air in Oslo and Rome?"},)",
              R"( {"role": "assistant", "content": "Checking."},)",
              R"( {"role": "tool_call", "content": "{\"name\": \"aqi\", \"arguments\": {\"zone\": \"z1\", \"city\": \"Oslo\"}}"},)",
              R"( {"role": "tool_call", "content": "{\"name\": \"aqi\", \"arguments\": {\"zone\": \"z2\", \"city\": \"Rome\"}}"},)",
              R"( {"role": "tool_response", "content": "10"}, {"role": "tool_response", "content": "72"},)",
              R"( {"role": "assistant", "content": "Oslo 10, Rome 72."}]})"),
      messages_form());
}

TEST(FormatTools, OpenAiArgumentsAsAJsonStringKeepTheirOrder) {
  const std::string line = str_cat(
      R"({"tools": )", kTools, R"(, "messages": [{"role": "user", "content": "Air in Oslo and Rome?"},)",
      R"( {"role": "assistant", "content": "Checking.", "tool_calls": [)",
      R"({"type": "function", "function": {"name": "aqi", "arguments": "{\"zone\": \"z1\", \"city\": \"Oslo\"}"}},)",
      R"( {"type": "function", "function": {"name": "aqi", "arguments": "{\"zone\": \"z2\", \"city\": \"Rome\"}"}}]},)",
      R"( {"role": "tool", "content": "10"}, {"role": "tool", "content": "72"},)",
      R"( {"role": "assistant", "content": "Oslo 10, Rome 72."}]})");
  expect_same_as_messages(line, messages_form());
  // "zone" before "city", as written, not sorted.
  const std::string text = data_test::qwen3_tokenizer().decode(build(line).input_ids);
  EXPECT_LT(text.find("<parameter=zone>"), text.find("<parameter=city>")) << text;
  EXPECT_LT(text.find("\"zone\""), text.find("\"city\"")) << "the tool schema keeps its order: " << text;
}

TEST(FormatTools, ToolResponsesAreNotTrainedAndCallsAre) {
  const std::string trained = supervised_text(build(messages_form()));
  EXPECT_NE(trained.find("<function=aqi>"), std::string::npos) << trained;
  EXPECT_EQ(trained.find("<tool_response>"), std::string::npos) << trained;
  EXPECT_NE(trained.find("Oslo 10, Rome 72."), std::string::npos) << trained;
}

TEST(FormatTools, BadToolCallsAreCountedSkips) {
  EXPECT_EQ(skip_of(R"({"messages": [{"role": "user", "content": "q"}, {"role": "tool_call", "content": "not json"}]})").reason,
            SkipReason::kBadConversation);
  EXPECT_EQ(skip_of(R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]})").reason,
            SkipReason::kBadConversation);
}

}  // namespace
}  // namespace deltamoe
