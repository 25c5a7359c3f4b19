// A model directory's own chat template (chat_template.jinja, chat_template.json or
// tokenizer_config.json's chat_template), the templates deltamoe's renderer is known to reproduce
// (by fingerprint), and the choice of renderer for a run: the model's template must be one of them
// unless --template names the renderer to use.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "tokenizer/chat_template.h"

namespace deltamoe {

struct ModelChatTemplate {
  std::string text;
  std::string source;  // the file it was read from
};

// The template a Hugging Face processor or tokenizer would load from model_dir, in transformers'
// order: chat_template.jinja, chat_template.json {"chat_template": ...}, tokenizer_config.json's
// chat_template (a string, or a list of {name, template} whose "default" entry is taken). nullopt
// when there is none. Throws naming the file when one is malformed.
std::optional<ModelChatTemplate> read_model_chat_template(const std::string& model_dir);

// FNV-1a 64 of the text with line ends normalised to \n, trailing white space of each line and
// leading/trailing blank lines removed (so a copy re-saved by another tool keeps its fingerprint).
uint64_t chat_template_fingerprint(std::string_view text);

// The renderer that reproduces a template with this fingerprint, or nullopt when none is known to.
std::optional<ChatFormat> known_chat_template(uint64_t fingerprint);

// The Qwen3.5 template deltamoe renders (tests/tokenizer/qwen3_5_chat_template.jinja, compiled in):
// what `init` and every save write as chat_template.jinja when the model has no template of its own.
std::string_view builtin_qwen35_chat_template();

// --template: "" (decide from the model's template), "qwen3_5"/"qwen3.5" or "qwen3". Without
// --template the model's template must be a known one (none at all: qwen3_5); otherwise throws,
// naming the file and its fingerprint and saying that --template picks the renderer.
ChatFormat resolve_chat_format(const std::string& model_dir, const std::string& template_name);

}  // namespace deltamoe
