// The Split pre-tokenizer of the Qwen tokenizers, hand-written: splits normalised text into the
// pieces that the tokenizer.json regex would match (Oniguruma semantics, leftmost-first).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace deltamoe {

enum class SplitPattern {
  kQwen2,   // Qwen2, Qwen2.5, Qwen3: letters are \p{L}
  kQwen35,  // Qwen3.5: letters are [\p{L}\p{M}], so combining marks stay with their letters
};

// Recognises the regex string of a tokenizer.json Split pre-tokenizer; nullopt for any other
// pattern (the hand-written splitter implements exactly these).
std::optional<SplitPattern> split_pattern_from_regex(const std::string& regex);

// Appends the pieces of text (valid UTF-8) to pieces, in order; the pieces cover the text.
void split_pieces(std::string_view text, SplitPattern pattern, std::vector<std::string_view>& pieces);

}  // namespace deltamoe
