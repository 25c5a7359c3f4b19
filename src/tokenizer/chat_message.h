// Chat conversations as the chat templates see them (OpenAI/HF message format), parsed from JSON:
// roles, content as text or a list of text/image/video parts, reasoning_content, tool calls, tools.
// JSON values that the templates print (tools, tool arguments) are kept pre-rendered the way
// Python's json.dumps / str() print them, so rendering needs no JSON library.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace deltamoe {

enum class ContentKind { kText, kImage, kVideo };

struct ContentPart {
  ContentKind kind = ContentKind::kText;
  std::string text;  // kText only
};

enum class ValueKind { kAbsent, kNull, kString, kObject, kOther };

struct ToolCall {
  std::string name;
  ValueKind arguments_kind = ValueKind::kAbsent;
  std::string arguments_text;  // the string itself (kString), else json.dumps(arguments)
  // kObject only: (name, value) in order, the value as the Qwen3.5 template prints it:
  // json.dumps for objects and lists, str() for scalars.
  std::vector<std::pair<std::string, std::string>> arguments;
};

struct ChatMessage {
  std::string role;                    // system, user, assistant, tool
  ValueKind content_kind = ValueKind::kString;  // kString, kOther (a list of parts), kNull/kAbsent
  std::vector<ContentPart> parts;      // a string content is one text part
  ValueKind reasoning_kind = ValueKind::kAbsent;
  std::string reasoning_content;       // reasoning_kind == kString
  std::vector<ToolCall> tool_calls;
};

struct ChatConversation {
  std::vector<ChatMessage> messages;
  std::vector<std::string> tools_json;  // json.dumps of each tool, key order kept
};

// messages_json: a JSON list of messages. tools_json: a JSON list of tools, or empty / "null".
// where names the source (file:line) in error messages.
ChatConversation parse_chat(std::string_view messages_json, std::string_view tools_json, const std::string& where);

// Python's str.strip() with no argument (Unicode white space, as Jinja's trim filter).
std::string_view python_strip(std::string_view text);

}  // namespace deltamoe
