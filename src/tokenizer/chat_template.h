// Chat rendering for the Qwen3 and Qwen3.5 chat formats, equal to their Jinja chat templates, with
// the origin of every rendered span (which message, which part of a turn) for SFT label masks.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/chat_message.h"

namespace deltamoe {

class Tokenizer;

enum class ChatFormat {
  kQwen3,   // Qwen3's tokenizer_config.json template (string contents only)
  kQwen35,  // Qwen3.5 (ChatML with image/video parts, XML tool calls)
};
// "qwen3" or "qwen3.5"; throws naming the accepted values otherwise.
ChatFormat chat_format_from_name(std::string_view name);

struct ChatOptions {
  bool add_generation_prompt = false;
  std::optional<bool> enable_thinking;  // unset = the template's default (thinking)
  bool add_vision_id = false;           // Qwen3.5: "Picture N: " before each image
  // A think block on every assistant turn, not only those after the last user query (ms-swift's
  // --add_non_thinking_prefix in training: earlier turns keep their reasoning, or get the empty block).
  bool think_on_every_turn = false;
};

// What a span of the rendered text is. Spans tile the text in order.
enum class SpanRole : uint8_t {
  kSystem,            // the system turn (with the tools block)
  kUser,              // a user turn, <|im_start|>user\n ... <|im_end|>\n
  kTool,              // tool responses (wrapped in a user turn)
  kAssistantHeader,   // <|im_start|>assistant\n
  kThink,             // <think>\n{reasoning}\n</think>\n\n with non-empty reasoning
  kEmptyThink,        // <think>\n\n</think>\n\n
  kAssistant,         // the answer and its tool calls
  kAssistantEnd,      // <|im_end|> closing an assistant turn
  kSeparator,         // the \n after an assistant's <|im_end|>
  kGenerationPrompt,  // <|im_start|>assistant\n<think>\n... added by add_generation_prompt
};
const char* span_role_name(SpanRole role);
// The default SFT mask: the answer, non-empty reasoning and the closing <|im_end|> are trained.
bool supervised_by_default(SpanRole role);

struct ChatSpan {
  uint32_t begin = 0, end = 0;  // byte range in RenderedChat::text
  int32_t message_index = -1;   // -1: not from a message (tools block without system, generation prompt)
  SpanRole role = SpanRole::kSystem;
};

struct RenderedChat {
  std::string text;
  std::vector<ChatSpan> spans;
  int num_images = 0;
  int num_videos = 0;
};

// Throws deltamoe::Error where the template raises (system not first, no user query in Qwen3.5,
// images in a system message, list content in Qwen3, ...).
RenderedChat render_chat(const ChatConversation& conversation, ChatFormat format, const ChatOptions& options);

// Encodes the whole rendered text (the ids equal tokenizer.encode(chat.text)) and gives each
// token the index into chat.spans of the span holding its first byte. A token can cross a span
// boundary only through white space (e.g. a header's "\n" merging with an answer's leading
// "\n\n"); it then belongs to the earlier span, so template text is never supervised.
void encode_chat(const Tokenizer& tokenizer, const RenderedChat& chat, std::vector<int32_t>& ids,
                 std::vector<int32_t>& span_of_token);

}  // namespace deltamoe
