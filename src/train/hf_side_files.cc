// generation_config.json and chat_template.jinja for model folders (see hf_side_files.h).
#include "train/hf_side_files.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/log.h"
#include "tokenizer/chat_template_source.h"

namespace deltamoe {

namespace fs = std::filesystem;

namespace {

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  CHECK(out.good(), "writing ", path.string(), " failed (disk full or not writable?)");
}

// The id of an added token in dir/tokenizer.json, or -1.
int64_t added_token_id(const fs::path& tokenizer_path, const std::string& content) {
  std::ifstream in(tokenizer_path, std::ios::binary);
  if (!in.good()) return -1;
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json json = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (!json.is_object() || !json.contains("added_tokens") || !json["added_tokens"].is_array()) return -1;
  for (const nlohmann::json& token : json["added_tokens"]) {
    if (token.is_object() && token.value("content", "") == content && token.contains("id") && token["id"].is_number_integer()) {
      return token["id"].get<int64_t>();
    }
  }
  return -1;
}

}  // namespace

void write_missing_side_files(const std::string& dir, const ModelConfig& config, ChatFormat format) {
  const fs::path folder(dir);
  if (!fs::exists(folder / "generation_config.json")) {
    // The Qwen special-token block is laid out the same in every model: <|endoftext|>,
    // <|im_start|>, <|im_end|>, ... <|image_pad|> 12 after <|endoftext|> (docs/checkpoints.md).
    int64_t end_of_text = added_token_id(folder / "tokenizer.json", "<|endoftext|>");
    int64_t im_end = added_token_id(folder / "tokenizer.json", "<|im_end|>");
    if (end_of_text < 0) end_of_text = config.image_token_id - 12;
    if (im_end < 0) im_end = config.image_token_id - 10;
    nlohmann::ordered_json generation;
    generation["bos_token_id"] = end_of_text;
    generation["eos_token_id"] = {im_end, end_of_text};
    generation["pad_token_id"] = end_of_text;
    write_text(folder / "generation_config.json", generation.dump(2) + "\n");
  }
  if (!fs::exists(folder / "chat_template.jinja")) {
    if (const std::optional<ModelChatTemplate> own = read_model_chat_template(dir)) {
      write_text(folder / "chat_template.jinja", own->text);
    } else if (format == ChatFormat::kQwen35) {
      write_text(folder / "chat_template.jinja", std::string(builtin_qwen35_chat_template()));
    } else {
      log_warn(dir, ": no chat template to write (the model has none and deltamoe carries only the Qwen3.5 one)");
    }
  }
}

}  // namespace deltamoe
