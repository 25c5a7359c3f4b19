// The files besides config.json and the weights that Hugging Face tools expect in a model folder and
// that `deltamoe init`, the demo and every save must leave: generation_config.json (so generate()
// stops at <|im_end|>) and chat_template.jinja (so tokenizers and processors render chats as deltamoe
// trained them). Files already there (copied from the input model) are kept.
#pragma once

#include <string>

#include "model/config.h"
#include "tokenizer/chat_template.h"

namespace deltamoe {

// Writes dir/generation_config.json when missing: eos = [<|im_end|>, <|endoftext|>], pad and bos =
// <|endoftext|>, ids from dir/tokenizer.json (else from the config's special-token block). Writes
// dir/chat_template.jinja when missing: the template another file of dir holds (chat_template.json,
// tokenizer_config.json), else, for the qwen3_5 renderer, deltamoe's Qwen3.5 template.
void write_missing_side_files(const std::string& dir, const ModelConfig& config, ChatFormat format);

}  // namespace deltamoe
