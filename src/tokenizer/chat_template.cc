// The Qwen3 and Qwen3.5 chat templates written out in C++, statement by statement, so that the
// output equals jinja2's; each piece of output is tagged with the message and part it came from.
#include "tokenizer/chat_template.h"

#include "core/error.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace deltamoe {
namespace {

const char* const kQwen3ToolsHeader =
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>";
const char* const kQwen3ToolsFooter =
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n";
const char* const kQwen35ToolsHeader = "# Tools\n\nYou have access to the following functions:\n\n<tools>";
const char* const kQwen35ToolsFooter =
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple "
    "lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the "
    "specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> "
    "XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function "
    "call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, "
    "answer the question like normal with your current knowledge and do not tell the user about function "
    "calls\n</IMPORTANT>";

// Output text plus its spans; consecutive pieces with the same origin share one span.
class ChatWriter {
 public:
  void write(std::string_view piece, int message_index, SpanRole role) {
    if (piece.empty()) return;
    const uint32_t begin = static_cast<uint32_t>(chat_.text.size());
    chat_.text += piece;
    const uint32_t end = static_cast<uint32_t>(chat_.text.size());
    if (!chat_.spans.empty() && chat_.spans.back().message_index == message_index && chat_.spans.back().role == role) {
      chat_.spans.back().end = end;
    } else {
      chat_.spans.push_back({begin, end, message_index, role});
    }
  }
  RenderedChat& chat() { return chat_; }

 private:
  RenderedChat chat_;
};

std::string_view strip_chars(std::string_view text, bool left, bool right, char c = '\n') {
  while (left && !text.empty() && text.front() == c) text.remove_prefix(1);
  while (right && !text.empty() && text.back() == c) text.remove_suffix(1);
  return text;
}

bool starts_with(std::string_view text, std::string_view prefix) { return text.substr(0, prefix.size()) == prefix; }
bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

// Python's s.split(sep)[0] and s.split(sep)[-1].
std::string_view before_first(std::string_view text, std::string_view sep) {
  const size_t at = text.find(sep);
  return at == std::string_view::npos ? text : text.substr(0, at);
}
std::string_view after_last(std::string_view text, std::string_view sep) {
  const size_t at = text.rfind(sep);
  return at == std::string_view::npos ? text : text.substr(at + sep.size());
}

// Reasoning and answer from an assistant content with an inline <think>...</think> block.
void split_inline_think(std::string_view content, std::string& reasoning, std::string& answer) {
  reasoning = strip_chars(after_last(strip_chars(before_first(content, "</think>"), false, true), "<think>"), true, false);
  answer = strip_chars(after_last(content, "</think>"), true, false);
}

void write_generation_prompt(ChatWriter& out, const ChatOptions& options, bool thinking_prefix_by_default) {
  if (!options.add_generation_prompt) return;
  out.write("<|im_start|>assistant\n", -1, SpanRole::kGenerationPrompt);
  if (options.enable_thinking.has_value() && !*options.enable_thinking) {
    out.write("<think>\n\n</think>\n\n", -1, SpanRole::kGenerationPrompt);
  } else if (thinking_prefix_by_default) {
    out.write("<think>\n", -1, SpanRole::kGenerationPrompt);
  }
}

void write_assistant_end(ChatWriter& out, int index) {
  out.write("<|im_end|>", index, SpanRole::kAssistantEnd);
  out.write("\n", index, SpanRole::kSeparator);
}

// ---------------------------------------------------------------------------------------------
// Qwen3 (tokenizer_config.json of Qwen3): contents are strings.

const std::string& qwen3_content(const ChatMessage& message, int index) {
  CHECK(message.content_kind == ValueKind::kString, "message ", index, " (", message.role,
        "): the Qwen3 chat format needs string content");
  return message.parts[0].text;
}

RenderedChat render_qwen3(const ChatConversation& conversation, const ChatOptions& options) {
  const auto& messages = conversation.messages;
  const int num_messages = static_cast<int>(messages.size());
  ChatWriter out;
  const bool system_first = num_messages > 0 && messages[0].role == "system";
  if (!conversation.tools_json.empty()) {
    const int index = system_first ? 0 : -1;
    out.write("<|im_start|>system\n", index, SpanRole::kSystem);
    if (system_first) out.write(qwen3_content(messages[0], 0) + "\n\n", 0, SpanRole::kSystem);
    out.write(kQwen3ToolsHeader, index, SpanRole::kSystem);
    for (const std::string& tool : conversation.tools_json) out.write("\n" + tool, index, SpanRole::kSystem);
    out.write(kQwen3ToolsFooter, index, SpanRole::kSystem);
  } else if (system_first) {
    out.write("<|im_start|>system\n" + qwen3_content(messages[0], 0) + "<|im_end|>\n", 0, SpanRole::kSystem);
  }

  // The last user message that is not a wrapped tool response.
  int last_query_index = num_messages - 1;
  for (int index = num_messages - 1; index >= 0; --index) {
    if (messages[index].role != "user") continue;
    const std::string& content = qwen3_content(messages[index], index);
    if (!(starts_with(content, "<tool_response>") && ends_with(content, "</tool_response>"))) {
      last_query_index = index;
      break;
    }
  }

  for (int index = 0; index < num_messages; ++index) {
    const ChatMessage& message = messages[index];
    if (message.role == "user" || (message.role == "system" && index != 0)) {
      const SpanRole role = message.role == "user" ? SpanRole::kUser : SpanRole::kSystem;
      out.write("<|im_start|>" + message.role + "\n" + qwen3_content(message, index) + "<|im_end|>\n", index, role);
    } else if (message.role == "assistant") {
      std::string content = qwen3_content(message, index);
      std::string reasoning;
      if (message.reasoning_kind == ValueKind::kString) {
        reasoning = message.reasoning_content;
      } else {
        CHECK(message.reasoning_kind == ValueKind::kAbsent || message.reasoning_kind == ValueKind::kNull, "message ",
              index, ": reasoning_content must be a string or null");
        if (content.find("</think>") != std::string::npos) {
          const std::string original = content;
          split_inline_think(original, reasoning, content);
        }
      }
      out.write("<|im_start|>assistant\n", index, SpanRole::kAssistantHeader);
      const bool is_last = index == num_messages - 1;
      if ((index > last_query_index && (is_last || !reasoning.empty())) || options.think_on_every_turn) {
        const std::string_view think = strip_chars(reasoning, true, true);
        out.write("<think>\n" + std::string(think) + "\n</think>\n\n", index,
                  think.empty() ? SpanRole::kEmptyThink : SpanRole::kThink);
        out.write(strip_chars(content, true, false), index, SpanRole::kAssistant);
      } else {
        out.write(content, index, SpanRole::kAssistant);
      }
      for (size_t call_index = 0; call_index < message.tool_calls.size(); ++call_index) {
        const ToolCall& call = message.tool_calls[call_index];
        if (call_index > 0 || !content.empty()) out.write("\n", index, SpanRole::kAssistant);
        CHECK(call.arguments_kind != ValueKind::kAbsent, "message ", index, ": tool call '", call.name,
              "' has no arguments");
        out.write("<tool_call>\n{\"name\": \"" + call.name + "\", \"arguments\": " + call.arguments_text + "}\n</tool_call>",
                  index, SpanRole::kAssistant);
      }
      write_assistant_end(out, index);
    } else if (message.role == "tool") {
      if (index == 0 || messages[index - 1].role != "tool") out.write("<|im_start|>user", index, SpanRole::kTool);
      out.write("\n<tool_response>\n" + qwen3_content(message, index) + "\n</tool_response>", index, SpanRole::kTool);
      if (index == num_messages - 1 || messages[index + 1].role != "tool") out.write("<|im_end|>\n", index, SpanRole::kTool);
    }
  }
  write_generation_prompt(out, options, /*thinking_prefix_by_default=*/false);
  return std::move(out.chat());
}

// ---------------------------------------------------------------------------------------------
// Qwen3.5 (our reconstruction in tests/tokenizer/qwen3_5_chat_template.jinja of the Qwen3.5 chat template).

// The template's render_content macro; counts images and videos when count_vision is set.
std::string render_content_qwen35(const ChatMessage& message, int index, bool count_vision, bool is_system,
                                  const ChatOptions& options, RenderedChat& chat) {
  std::string out;
  for (const ContentPart& part : message.parts) {
    if (part.kind == ContentKind::kText) {
      out += part.text;
      continue;
    }
    const bool image = part.kind == ContentKind::kImage;
    CHECK(!is_system, "message ", index, ": a system message cannot contain ", image ? "images" : "videos");
    int& count = image ? chat.num_images : chat.num_videos;
    if (count_vision) ++count;
    if (options.add_vision_id) out += str_cat(image ? "Picture " : "Video ", count, ": ");
    out += image ? "<|vision_start|><|image_pad|><|vision_end|>" : "<|vision_start|><|video_pad|><|vision_end|>";
  }
  return out;
}

RenderedChat render_qwen35(const ChatConversation& conversation, const ChatOptions& options) {
  const auto& messages = conversation.messages;
  const int num_messages = static_cast<int>(messages.size());
  CHECK(num_messages > 0, "a conversation needs at least one message");
  ChatWriter out;
  RenderedChat& chat = out.chat();
  const bool system_first = messages[0].role == "system";
  if (!conversation.tools_json.empty()) {
    const int index = system_first ? 0 : -1;
    out.write("<|im_start|>system\n", index, SpanRole::kSystem);
    out.write(kQwen35ToolsHeader, index, SpanRole::kSystem);
    for (const std::string& tool : conversation.tools_json) out.write("\n" + tool, index, SpanRole::kSystem);
    out.write(kQwen35ToolsFooter, index, SpanRole::kSystem);
    if (system_first) {
      const std::string content(python_strip(render_content_qwen35(messages[0], 0, false, true, options, chat)));
      if (!content.empty()) out.write("\n\n" + content, 0, SpanRole::kSystem);
    }
    out.write("<|im_end|>\n", index, SpanRole::kSystem);
  } else if (system_first) {
    const std::string content(python_strip(render_content_qwen35(messages[0], 0, false, true, options, chat)));
    out.write("<|im_start|>system\n" + content + "<|im_end|>\n", 0, SpanRole::kSystem);
  }

  int last_query_index = -1;
  for (int index = num_messages - 1; index >= 0 && last_query_index < 0; --index) {
    if (messages[index].role != "user") continue;
    const std::string rendered = render_content_qwen35(messages[index], index, false, false, options, chat);
    const std::string_view content = python_strip(rendered);
    if (!(starts_with(content, "<tool_response>") && ends_with(content, "</tool_response>"))) last_query_index = index;
  }
  CHECK(last_query_index >= 0, "the conversation has no user query (the Qwen3.5 template requires one)");

  for (int index = 0; index < num_messages; ++index) {
    const ChatMessage& message = messages[index];
    const std::string rendered = render_content_qwen35(message, index, true, false, options, chat);
    std::string content(python_strip(rendered));
    if (message.role == "system") {
      CHECK(index == 0, "message ", index, ": a system message must come first");
    } else if (message.role == "user") {
      out.write("<|im_start|>user\n" + content + "<|im_end|>\n", index, SpanRole::kUser);
    } else if (message.role == "assistant") {
      std::string reasoning;
      if (message.reasoning_kind == ValueKind::kString) {
        reasoning = message.reasoning_content;
      } else if (content.find("</think>") != std::string::npos) {
        const std::string original = content;
        split_inline_think(original, reasoning, content);
      }
      reasoning = std::string(python_strip(reasoning));
      out.write("<|im_start|>assistant\n", index, SpanRole::kAssistantHeader);
      if (index > last_query_index || options.think_on_every_turn) {
        out.write("<think>\n" + reasoning + "\n</think>\n\n", index,
                  reasoning.empty() ? SpanRole::kEmptyThink : SpanRole::kThink);
      }
      out.write(content, index, SpanRole::kAssistant);
      for (size_t call_index = 0; call_index < message.tool_calls.size(); ++call_index) {
        const ToolCall& call = message.tool_calls[call_index];
        const char* prefix = call_index > 0 ? "\n<tool_call>\n<function=" :
                             !python_strip(content).empty() ? "\n\n<tool_call>\n<function=" : "<tool_call>\n<function=";
        out.write(prefix + call.name + ">\n", index, SpanRole::kAssistant);
        if (call.arguments_kind != ValueKind::kAbsent) {
          CHECK(call.arguments_kind == ValueKind::kObject, "message ", index, ": the arguments of tool call '", call.name,
                "' must be an object in the Qwen3.5 format");
          for (const auto& [name, value] : call.arguments) {
            out.write("<parameter=" + name + ">\n" + value + "\n</parameter>\n", index, SpanRole::kAssistant);
          }
        }
        out.write("</function>\n</tool_call>", index, SpanRole::kAssistant);
      }
      write_assistant_end(out, index);
    } else if (message.role == "tool") {
      // NOTE: as in the template, a tool message at index 0 gets no <|im_start|>user header.
      if (index > 0 && messages[index - 1].role != "tool") out.write("<|im_start|>user", index, SpanRole::kTool);
      out.write("\n<tool_response>\n" + content + "\n</tool_response>", index, SpanRole::kTool);
      if (index == num_messages - 1 || messages[index + 1].role != "tool") out.write("<|im_end|>\n", index, SpanRole::kTool);
    }
  }
  write_generation_prompt(out, options, /*thinking_prefix_by_default=*/true);
  return std::move(out.chat());
}

}  // namespace

ChatFormat chat_format_from_name(std::string_view name) {
  if (name == "qwen3") return ChatFormat::kQwen3;
  if (name == "qwen3.5" || name == "qwen3_5") return ChatFormat::kQwen35;
  RAISE("unknown chat format '", name, "' (expected qwen3 or qwen3.5)");
}

const char* span_role_name(SpanRole role) {
  switch (role) {
    case SpanRole::kSystem: return "system";
    case SpanRole::kUser: return "user";
    case SpanRole::kTool: return "tool";
    case SpanRole::kAssistantHeader: return "assistant_header";
    case SpanRole::kThink: return "think";
    case SpanRole::kEmptyThink: return "empty_think";
    case SpanRole::kAssistant: return "assistant";
    case SpanRole::kAssistantEnd: return "assistant_end";
    case SpanRole::kSeparator: return "separator";
    case SpanRole::kGenerationPrompt: return "generation_prompt";
  }
  return "?";
}

bool supervised_by_default(SpanRole role) {
  return role == SpanRole::kThink || role == SpanRole::kAssistant || role == SpanRole::kAssistantEnd;
}

RenderedChat render_chat(const ChatConversation& conversation, ChatFormat format, const ChatOptions& options) {
  return format == ChatFormat::kQwen3 ? render_qwen3(conversation, options) : render_qwen35(conversation, options);
}

void encode_chat(const Tokenizer& tokenizer, const RenderedChat& chat, std::vector<int32_t>& ids,
                 std::vector<int32_t>& span_of_token) {
  ids = tokenizer.encode(chat.text);
  span_of_token.assign(ids.size(), 0);
  // Token sizes count bytes of NFC text, so span ends are measured on each span's NFC form
  // (spans start at special tokens or after newlines, where NFC cannot reach across).
  std::vector<size_t> span_ends;
  size_t end = 0;
  for (const ChatSpan& span : chat.spans) {
    end += nfc_normalize(std::string_view(chat.text).substr(span.begin, span.end - span.begin)).size();
    span_ends.push_back(end);
  }
  size_t offset = 0, span = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    while (span + 1 < span_ends.size() && offset >= span_ends[span]) ++span;
    span_of_token[i] = static_cast<int32_t>(span);
    offset += tokenizer.token_text_size(ids[i]);
  }
  CHECK(offset == end, "internal: chat tokens cover ", offset, " bytes of normalised text, the spans ", end);
}

}  // namespace deltamoe
