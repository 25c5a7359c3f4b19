// The dataset line layouts ms-swift reads, brought to one form before images and rendering: the
// messages form ({"messages": [{"role", "content", ...}]}, also under "conversations" /
// "conversation"), ShareGPT ({"from", "value"} turns, or {"human", "assistant"} pairs), alpaca
// (instruction / input / output) and query / response / history, with a top-level "system", "tools",
// the "image" / "images" keys, ms-swift's tool_call / tool_response roles, OpenAI tool calls whose
// arguments are a JSON string, and per-message "loss". Key order is kept everywhere (ordered_json).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace deltamoe {

// The line's layout, for messages and tests.
enum class RecordLayout { kMessages, kShareGpt, kSharePairs, kAlpaca, kQueryResponse };
const char* record_layout_name(RecordLayout layout);

struct NormalisedRecord {
  RecordLayout layout = RecordLayout::kMessages;
  // {"messages": [...], "images": [...] (when given), "tools": ... (when given)}: roles are system,
  // user, assistant and tool; assistant tool calls are {"type": "function", "function": {"name",
  // "arguments": {...}}}; a message's "loss" (true/false) is kept on it.
  nlohmann::ordered_json root;
};

// Throws SampleSkip naming `where`: kBadConversation for a layout it cannot read (with what was
// expected), kUnsupported for forms deltamoe does not train yet, with the form as the skip's detail
// (video, audio, objects, anthropic_blocks, loss_scale).
NormalisedRecord normalise_record(nlohmann::ordered_json root, const std::string& where);

}  // namespace deltamoe
