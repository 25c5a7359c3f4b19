// Parsing chat messages from JSON, and printing JSON values as Python's json.dumps and str() do
// (the chat templates run under transformers, whose tojson is json.dumps(ensure_ascii=False)).
#include "tokenizer/chat_message.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_depth.h"
#include "tokenizer/unicode.h"

namespace deltamoe {
namespace {

using Json = nlohmann::ordered_json;

// repr(float): shortest round-trip digits; exponent form below 1e-4 or from 1e16 on.
std::string python_float(double value, const std::string& where) {
  CHECK(std::isfinite(value), where, ": NaN or infinite numbers are not supported in chat JSON");
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::scientific);
  std::string scientific(buffer, result.ptr);  // like -1.2345e-05
  const size_t e = scientific.find('e');
  const int exponent = std::stoi(scientific.substr(e + 1));
  const bool negative = scientific[0] == '-';
  std::string digits;
  for (char c : scientific.substr(0, e)) {
    if (c >= '0' && c <= '9') digits += c;
  }
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  // NOTE: built with append() only; operator+ chains here trip GCC 12's -Wrestrict false positive.
  std::string out;
  if (negative) out.append("-");
  if (exponent < -4 || exponent >= 16) {
    out.push_back(digits[0]);
    if (digits.size() > 1) out.append(".").append(digits, 1, std::string::npos);
    char exp_text[16];
    std::snprintf(exp_text, sizeof(exp_text), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    return out.append(exp_text);
  }
  if (exponent < 0) return out.append("0.").append(static_cast<size_t>(-exponent - 1), '0').append(digits);
  const size_t integer_digits = static_cast<size_t>(exponent) + 1;
  if (digits.size() <= integer_digits) return out.append(digits).append(integer_digits - digits.size(), '0').append(".0");
  return out.append(digits, 0, integer_digits).append(".").append(digits, integer_digits, std::string::npos);
}

void append_python_json_string(const std::string& text, std::string& out) {
  out += '"';
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escape[8];
          std::snprintf(escape, sizeof(escape), "\\u%04x", static_cast<unsigned char>(c));
          out += escape;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

// json.dumps(value, ensure_ascii=False) with the default separators ", " and ": ".
void append_python_json(const Json& value, std::string& out, const std::string& where) {
  switch (value.type()) {
    case Json::value_t::null: out += "null"; break;
    case Json::value_t::boolean: out += value.get<bool>() ? "true" : "false"; break;
    case Json::value_t::number_integer: out += std::to_string(value.get<int64_t>()); break;
    case Json::value_t::number_unsigned: out += std::to_string(value.get<uint64_t>()); break;
    case Json::value_t::number_float: out += python_float(value.get<double>(), where); break;
    case Json::value_t::string: append_python_json_string(value.get<std::string>(), out); break;
    case Json::value_t::array: {
      out += '[';
      bool first = true;
      for (const Json& item : value) {
        if (!first) out += ", ";
        first = false;
        append_python_json(item, out, where);
      }
      out += ']';
      break;
    }
    case Json::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& [key, item] : value.items()) {
        if (!first) out += ", ";
        first = false;
        append_python_json_string(key, out);
        out += ": ";
        append_python_json(item, out, where);
      }
      out += '}';
      break;
    }
    default: RAISE(where, ": unsupported JSON value ", value.dump());
  }
}

std::string python_json(const Json& value, const std::string& where) {
  std::string out;
  append_python_json(value, out, where);
  return out;
}

// str(value) for a scalar: True/False/None, repr of floats, the string itself.
std::string python_str(const Json& value, const std::string& where) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_boolean()) return value.get<bool>() ? "True" : "False";
  if (value.is_null()) return "None";
  return python_json(value, where);
}

ValueKind kind_of(const Json& object, const char* key) {
  if (!object.contains(key)) return ValueKind::kAbsent;
  const Json& value = object[key];
  if (value.is_null()) return ValueKind::kNull;
  if (value.is_string()) return ValueKind::kString;
  if (value.is_object()) return ValueKind::kObject;
  return ValueKind::kOther;
}

ContentPart parse_part(const Json& item, const std::string& where) {
  CHECK(item.is_object(), where, ": a content part must be an object, got ", item.dump());
  const std::string type = item.contains("type") && item["type"].is_string() ? item["type"].get<std::string>() : "";
  // Same order of tests as the Qwen3.5 template's render_content.
  if (item.contains("image") || item.contains("image_url") || type == "image") return {ContentKind::kImage, ""};
  if (item.contains("video") || type == "video") return {ContentKind::kVideo, ""};
  if (item.contains("text")) {
    CHECK(item["text"].is_string(), where, ": a text part's 'text' must be a string, got ", item["text"].dump());
    return {ContentKind::kText, item["text"].get<std::string>()};
  }
  RAISE(where, ": content part ", item.dump(), " is neither text, image nor video");
}

ToolCall parse_tool_call(const Json& entry, const std::string& where) {
  CHECK(entry.is_object(), where, ": a tool call must be an object, got ", entry.dump());
  const bool wrapped = entry.contains("function") && entry["function"].is_object();
  const Json& call = wrapped ? entry["function"] : entry;
  ToolCall tool_call;
  CHECK(call.contains("name") && call["name"].is_string(), where, ": a tool call needs a string 'name': ", entry.dump());
  tool_call.name = call["name"].get<std::string>();
  tool_call.arguments_kind = kind_of(call, "arguments");
  if (tool_call.arguments_kind == ValueKind::kString) {
    tool_call.arguments_text = call["arguments"].get<std::string>();
  } else if (tool_call.arguments_kind != ValueKind::kAbsent) {
    tool_call.arguments_text = python_json(call["arguments"], where);
  }
  if (tool_call.arguments_kind == ValueKind::kObject) {
    for (const auto& [key, value] : call["arguments"].items()) {
      tool_call.arguments.emplace_back(key, value.is_object() || value.is_array() ? python_json(value, where)
                                                                                  : python_str(value, where));
    }
  }
  return tool_call;
}

ChatMessage parse_message(const Json& entry, const std::string& where) {
  CHECK(entry.is_object() && entry.contains("role") && entry["role"].is_string(), where,
        ": a message must be an object with a string 'role', got ", entry.dump().substr(0, 200));
  ChatMessage message;
  message.role = entry["role"].get<std::string>();
  CHECK(message.role == "system" || message.role == "user" || message.role == "assistant" || message.role == "tool",
        where, ": unknown role '", message.role, "' (expected system, user, assistant or tool)");
  message.content_kind = kind_of(entry, "content");
  if (message.content_kind == ValueKind::kString) {
    message.parts.push_back({ContentKind::kText, entry["content"].get<std::string>()});
  } else if (message.content_kind == ValueKind::kOther && entry["content"].is_array()) {
    for (const Json& item : entry["content"]) message.parts.push_back(parse_part(item, where));
  } else {
    CHECK(message.content_kind == ValueKind::kNull || message.content_kind == ValueKind::kAbsent, where,
          ": 'content' must be a string, a list of parts or null, got ", entry["content"].dump().substr(0, 200));
  }
  message.reasoning_kind = kind_of(entry, "reasoning_content");
  if (message.reasoning_kind == ValueKind::kString) message.reasoning_content = entry["reasoning_content"].get<std::string>();
  if (entry.contains("tool_calls") && !entry["tool_calls"].is_null()) {
    CHECK(entry["tool_calls"].is_array(), where, ": 'tool_calls' must be a list");
    for (const Json& call : entry["tool_calls"]) message.tool_calls.push_back(parse_tool_call(call, where));
  }
  return message;
}

}  // namespace

ChatConversation parse_chat(std::string_view messages_json, std::string_view tools_json, const std::string& where) {
  ChatConversation conversation;
  Json messages, tools;
  // The printers below recurse once per level: bound the depth before parsing.
  CHECK(json_nesting_depth(messages_json) <= kMaxJsonDepth && json_nesting_depth(tools_json) <= kMaxJsonDepth, where,
        ": JSON in a conversation is nested more than ", kMaxJsonDepth, " levels deep");
  try {
    messages = Json::parse(messages_json);
    if (!tools_json.empty()) tools = Json::parse(tools_json);
  } catch (const Json::exception& error) {
    RAISE(where, ": invalid JSON in a conversation: ", error.what());
  }
  CHECK(messages.is_array(), where, ": 'messages' must be a list");
  try {
    for (const Json& entry : messages) conversation.messages.push_back(parse_message(entry, where));
    if (!tools.is_null()) {
      CHECK(tools.is_array(), where, ": 'tools' must be a list");
      for (const Json& tool : tools) conversation.tools_json.push_back(python_json(tool, where));
    }
  } catch (const Json::exception& error) {  // a value of an unexpected type that a check missed
    RAISE(where, ": unexpected JSON layout in a conversation (", error.what(), ")");
  }
  return conversation;
}

std::string_view python_strip(std::string_view text) {
  // str.isspace(): the code points with bidirectional class WS, B or S, or category Zs.
  const auto is_space = [](char32_t cp) {
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
  };
  size_t begin = 0;
  while (begin < text.size()) {
    size_t next = begin;
    if (!is_space(next_code_point(text, next))) break;
    begin = next;
  }
  size_t end = text.size();
  while (end > begin) {
    size_t start = end - 1;
    while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
    size_t next = start;
    if (!is_space(next_code_point(text, next))) break;
    end = start;
  }
  return text.substr(begin, end - begin);
}

}  // namespace deltamoe
