// Dataset line layouts -> the messages form (see record_formats.h). The key names follow ms-swift's
// preprocessors (swift/dataset/preprocessor/core.py): which fields hold the query, the response
// and the system prompt, and which role names mean user, assistant and tools.
#include "data/record_formats.h"

#include <algorithm>
#include <array>
#include <optional>

#include "core/error.h"
#include "core/json_depth.h"
#include "data/sample_skip.h"

namespace deltamoe {
namespace {

using Json = nlohmann::ordered_json;

[[noreturn]] void bad(const std::string& where, const std::string& message) {
  throw SampleSkip(SkipReason::kBadConversation, where + ": " + message);
}

[[noreturn]] void unsupported(const std::string& where, const std::string& detail, const std::string& message) {
  throw SampleSkip(SkipReason::kUnsupported, where + ": " + message, detail);
}

constexpr std::array<const char*, 3> kMessageKeys = {"messages", "conversations", "conversation"};
constexpr std::array<const char*, 2> kSystemKeys = {"system", "system_prompt"};
constexpr std::array<const char*, 6> kQueryKeys = {"query", "prompt", "input", "instruction", "question", "problem"};
constexpr std::array<const char*, 11> kResponseKeys = {"response", "answer", "output", "targets", "target", "answer_key",
                                                       "answers", "solution", "text", "completion", "content"};

bool present(const Json& root, const char* key) { return root.contains(key) && !root[key].is_null(); }

// A non-empty list or string under key (the multimodal keys: a string is one item).
bool has_items(const Json& root, const char* key) {
  if (!present(root, key)) return false;
  const Json& value = root[key];
  return value.is_string() ? !value.get_ref<const std::string&>().empty() : !(value.is_array() && value.empty());
}

std::string text_of(const Json& value, const std::string& where, const char* what) {
  if (value.is_string()) return value.get<std::string>();
  // ms-swift takes the first of several responses.
  if (value.is_array() && !value.empty() && value[0].is_string()) return value[0].get<std::string>();
  bad(where, str_cat("'", what, "' must be a string, got ", value.dump().substr(0, 200)));
}

std::string role_in_swift(const std::string& role) {
  if (role == "human" || role == "user") return "user";
  if (role == "gpt" || role == "bot" || role == "assistant") return "assistant";
  if (role == "function_call" || role == "function-call" || role == "tool_call") return "tool_call";
  if (role == "function_response" || role == "observation" || role == "observations" || role == "tool_response" ||
      role == "tool") {
    return "tool";
  }
  return role;  // system, or a role the chat parser will name as unknown
}

// A tool call's arguments: an object stays; a JSON string holding an object becomes that object
// (key order kept), as the Qwen3.5 template prints each argument; other strings stay strings.
Json arguments_value(const Json& arguments, const std::string& where) {
  if (!arguments.is_string()) return arguments;
  const std::string& text = arguments.get_ref<const std::string&>();
  if (json_nesting_depth(text) > kMaxJsonDepth) {
    throw SampleSkip(SkipReason::kMalformedJson, str_cat(where, ": tool call arguments nested more than ", kMaxJsonDepth,
                                                         " levels deep"));
  }
  try {
    Json parsed = Json::parse(text);
    if (parsed.is_object()) return parsed;
  } catch (const Json::exception&) {
    bad(where, "tool call arguments are a string that is not JSON: " + text.substr(0, 200));
  }
  return arguments;
}

// {"name", "arguments"} of a tool_call message's content (a JSON string or an object).
Json tool_call_of(const Json& content, const std::string& where) {
  Json call = content;
  if (content.is_string()) {
    const std::string& text = content.get_ref<const std::string&>();
    if (json_nesting_depth(text) > kMaxJsonDepth) {
      throw SampleSkip(SkipReason::kMalformedJson, str_cat(where, ": a tool_call nested more than ", kMaxJsonDepth,
                                                           " levels deep"));
    }
    try {
      call = Json::parse(text);
    } catch (const Json::exception&) {
      bad(where, "a tool_call message's content must be JSON {\"name\": ..., \"arguments\": ...}, got " + text.substr(0, 200));
    }
  }
  if (!call.is_object() || !call.contains("name") || !call["name"].is_string()) {
    bad(where, "a tool_call message's content must be {\"name\": ..., \"arguments\": ...}, got " + call.dump().substr(0, 200));
  }
  Json function = Json::object();
  function["name"] = call["name"];
  if (call.contains("arguments")) function["arguments"] = arguments_value(call["arguments"], where);
  return Json{{"type", "function"}, {"function", std::move(function)}};
}

// A message's "loss" / "loss_scale" as true / false (absent: nothing).
void normalise_loss(Json& message, const std::string& where) {
  if (message.contains("loss_scale") && !message["loss_scale"].is_null()) {
    const Json& scale = message["loss_scale"];
    if (!scale.is_number() || (scale.get<double>() != 0.0 && scale.get<double>() != 1.0)) {
      unsupported(where, "loss_scale", "a per-message loss_scale other than 0 or 1 is not supported (weighted losses)");
    }
    if (!message.contains("loss") || message["loss"].is_null()) message["loss"] = scale.get<double>() != 0.0;
    message.erase("loss_scale");
  }
  if (message.contains("loss")) {
    if (message["loss"].is_null()) {
      message.erase("loss");
    } else if (!message["loss"].is_boolean()) {
      bad(where, "a message's 'loss' must be true, false or null, got " + message["loss"].dump());
    }
  }
}

// Content parts of forms deltamoe does not train: skipped under their own detail.
void check_parts(const Json& content, const std::string& where) {
  if (!content.is_array()) return;
  for (const Json& part : content) {
    if (!part.is_object()) continue;
    const std::string type = part.contains("type") && part["type"].is_string() ? part["type"].get<std::string>() : "";
    if (type == "video" || type == "video_url" || part.contains("video") || part.contains("video_url")) {
      unsupported(where, "video", "videos are not supported yet");
    }
    if (type == "audio" || type == "input_audio" || type == "audio_url" || part.contains("audio")) {
      unsupported(where, "audio", "audio is not supported");
    }
    if (type == "tool_use" || type == "tool_result" || (type == "image" && part.contains("source"))) {
      unsupported(where, "anthropic_blocks",
                  "Anthropic content blocks (tool_use, tool_result, image source) are not supported; write OpenAI "
                  "tool_calls and image parts");
    }
  }
}

bool mentions_tag(const Json& content, const char* tag) {
  if (content.is_string()) return content.get_ref<const std::string&>().find(tag) != std::string::npos;
  if (!content.is_array()) return false;
  for (const Json& part : content) {
    if (part.is_object() && part.contains("text") && part["text"].is_string() &&
        part["text"].get_ref<const std::string&>().find(tag) != std::string::npos) {
      return true;
    }
  }
  return false;
}

// ms-swift's roles -> the chat template's: tool_call messages join the assistant turn before them
// (or start one) as tool_calls; tool_response becomes tool. The first explicit "loss" of a merged
// turn decides it.
Json merge_tool_roles(const Json& messages, const std::string& where) {
  Json out = Json::array();
  bool last_is_open_assistant = false;  // the last message is an assistant turn tool calls may join
  for (const Json& input : messages) {
    if (!input.is_object()) bad(where, "a message must be an object, got " + input.dump().substr(0, 200));
    Json message = input;
    if (message.contains("role") && message["role"].is_string()) {
      message["role"] = role_in_swift(message["role"].get<std::string>());
    }
    normalise_loss(message, where);
    if (message.contains("content")) check_parts(message["content"], where);
    // ms-swift's tool responses are JSON strings; an object written as such is printed back to one.
    if (message.contains("role") && message["role"] == "tool" && message.contains("content") &&
        message["content"].is_object()) {
      message["content"] = message["content"].dump();
    }
    const bool is_tool_call = message.contains("role") && message["role"] == "tool_call";
    if (!is_tool_call) {
      if (message.contains("tool_calls") && message["tool_calls"].is_array()) {
        for (Json& call : message["tool_calls"]) {
          if (!call.is_object()) continue;
          Json& function = call.contains("function") && call["function"].is_object() ? call["function"] : call;
          if (function.contains("arguments")) function["arguments"] = arguments_value(function["arguments"], where);
        }
      }
      last_is_open_assistant = message.contains("role") && message["role"] == "assistant";
      out.push_back(std::move(message));
      continue;
    }
    Json call = tool_call_of(message.contains("content") ? message["content"] : Json(), where);
    if (!last_is_open_assistant) {
      Json assistant = Json::object();
      assistant["role"] = "assistant";
      assistant["content"] = "";
      out.push_back(std::move(assistant));
      last_is_open_assistant = true;
    }
    Json& assistant = out.back();
    if (!assistant.contains("tool_calls") || !assistant["tool_calls"].is_array()) assistant["tool_calls"] = Json::array();
    assistant["tool_calls"].push_back(std::move(call));
    if (message.contains("loss") && !assistant.contains("loss")) assistant["loss"] = message["loss"];
  }
  return out;
}

// [{"from": "human", "value": ...}] (ShareGPT) -> [{"role": "user", "content": ...}].
Json from_value_turns(const Json& turns, const std::string& where) {
  Json out = Json::array();
  for (const Json& turn : turns) {
    if (!turn.is_object()) bad(where, "a conversation turn must be an object, got " + turn.dump().substr(0, 200));
    Json message = Json::object();
    for (const auto& [key, value] : turn.items()) {
      if (key == "from") message["role"] = value;
      else if (key == "value") message["content"] = value;
      else message[key] = value;
    }
    out.push_back(std::move(message));
  }
  return out;
}

// ms-swift's ShareGPT pairs [{"human": q, "assistant": r}] -> alternating messages.
Json pair_turns(const Json& turns, const std::string& where) {
  Json out = Json::array();
  for (const Json& turn : turns) {
    if (!turn.is_object()) bad(where, "a conversation turn must be an object, got " + turn.dump().substr(0, 200));
    const char* user_key = turn.contains("human") ? "human" : "user";
    const char* assistant_key = turn.contains("assistant") ? "assistant" : turn.contains("gpt") ? "gpt" : "bot";
    if (!turn.contains(user_key) && !turn.contains(assistant_key)) {
      bad(where, "a conversation turn needs 'role'/'content', 'from'/'value' or 'human'/'assistant', got " +
                     turn.dump().substr(0, 200));
    }
    if (turn.contains(user_key)) out.push_back(Json{{"role", "user"}, {"content", turn[user_key]}});
    if (turn.contains(assistant_key)) out.push_back(Json{{"role", "assistant"}, {"content", turn[assistant_key]}});
  }
  return out;
}

// query / response / history (and alpaca's instruction + input) -> messages.
Json query_response_messages(const Json& root, RecordLayout layout, const std::string& where) {
  std::string query;
  bool has_query = false;
  if (layout == RecordLayout::kAlpaca) {
    const std::string instruction = present(root, "instruction") ? text_of(root["instruction"], where, "instruction") : "";
    const std::string input = present(root, "input") ? text_of(root["input"], where, "input") : "";
    query = !instruction.empty() && !input.empty() ? instruction + "\n" + input : instruction.empty() ? input : instruction;
    has_query = true;
  } else {
    for (const char* key : kQueryKeys) {
      if (present(root, key)) {
        query = text_of(root[key], where, key);
        has_query = true;
        break;
      }
    }
  }
  std::optional<std::string> response;
  for (const char* key : kResponseKeys) {
    if (present(root, key)) {
      response = text_of(root[key], where, key);
      break;
    }
  }
  Json messages = Json::array();
  if (present(root, "history")) {
    const Json& history = root["history"];
    if (!history.is_array()) bad(where, "'history' must be a list of [query, response] pairs");
    for (const Json& pair : history) {
      if (!pair.is_array() || pair.size() != 2 || !pair[0].is_string() || !pair[1].is_string()) {
        bad(where, "each 'history' entry must be [query, response], got " + pair.dump().substr(0, 200));
      }
      messages.push_back(Json{{"role", "user"}, {"content", pair[0]}});
      messages.push_back(Json{{"role", "assistant"}, {"content", pair[1]}});
    }
  }
  if (has_query) messages.push_back(Json{{"role", "user"}, {"content", query}});
  if (response) messages.push_back(Json{{"role", "assistant"}, {"content", *response}});
  return messages;
}

}  // namespace

const char* record_layout_name(RecordLayout layout) {
  switch (layout) {
    case RecordLayout::kMessages: return "messages";
    case RecordLayout::kShareGpt: return "sharegpt";
    case RecordLayout::kSharePairs: return "sharegpt_pairs";
    case RecordLayout::kAlpaca: return "alpaca";
    case RecordLayout::kQueryResponse: return "query_response";
  }
  return "?";
}

NormalisedRecord normalise_record(Json root, const std::string& where) {
  if (!root.is_object()) throw SampleSkip(SkipReason::kMalformedJson, where + ": a line must be a JSON object");
  // Forms deltamoe does not train, each counted under its own detail.
  if (has_items(root, "videos") || has_items(root, "video")) unsupported(where, "video", "videos are not supported yet");
  if (has_items(root, "audios") || has_items(root, "audio")) unsupported(where, "audio", "audio is not supported");
  if (present(root, "objects")) {
    unsupported(where, "objects", "grounding 'objects' (ref / bbox placeholders) are not supported; write the boxes "
                                  "into the text");
  }

  NormalisedRecord record;
  Json messages;
  const char* messages_key = nullptr;
  for (const char* key : kMessageKeys) {
    if (root.contains(key)) {
      messages_key = key;
      break;
    }
  }
  if (messages_key != nullptr) {
    const Json& turns = root[messages_key];
    if (!turns.is_array() || turns.empty()) bad(where, str_cat("expected a non-empty '", messages_key, "' list"));
    const bool role_form = turns[0].is_object() && (turns[0].contains("role") || turns[0].contains("content"));
    const bool from_form = turns[0].is_object() && (turns[0].contains("from") || turns[0].contains("value"));
    if (role_form) {
      record.layout = RecordLayout::kMessages;
      messages = turns;
    } else if (from_form) {
      record.layout = RecordLayout::kShareGpt;
      messages = from_value_turns(turns, where);
    } else {
      record.layout = RecordLayout::kSharePairs;
      messages = pair_turns(turns, where);
    }
  } else if (present(root, "instruction") && (present(root, "input") || present(root, "output"))) {
    record.layout = RecordLayout::kAlpaca;
    messages = query_response_messages(root, record.layout, where);
  } else {
    record.layout = RecordLayout::kQueryResponse;
    messages = query_response_messages(root, record.layout, where);
    if (messages.empty()) {
      bad(where, "expected a non-empty 'messages' list (or 'conversations', alpaca's instruction/input/output, or "
                 "query/response)");
    }
  }
  messages = merge_tool_roles(messages, where);

  // A top-level system prompt goes first unless the conversation starts with its own (ms-swift's rule).
  for (const char* key : kSystemKeys) {
    if (!present(root, key)) continue;
    const Json& system = root[key];
    if (!system.is_string()) bad(where, str_cat("'", key, "' must be a string"));
    const bool has_own = !messages.empty() && messages[0].is_object() && messages[0].contains("role") &&
                         messages[0]["role"] == "system";
    if (!has_own) messages.insert(messages.begin(), Json{{"role", "system"}, {"content", system}});
    break;
  }
  for (const Json& message : messages) {
    if (message.is_object() && message.contains("content") && mentions_tag(message["content"], "<video>")) {
      unsupported(where, "video", "a <video> tag: videos are not supported yet");
    }
    if (message.is_object() && message.contains("content") && mentions_tag(message["content"], "<audio>")) {
      unsupported(where, "audio", "an <audio> tag: audio is not supported");
    }
  }

  record.root = Json::object();
  record.root["messages"] = std::move(messages);
  if (present(root, "images")) record.root["images"] = root["images"];
  else if (present(root, "image")) record.root["images"] = root["image"];
  if (present(root, "tools")) record.root["tools"] = root["tools"];
  return record;
}

}  // namespace deltamoe
