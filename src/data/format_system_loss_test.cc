// A top-level "system" (and "system_prompt") on any layout, and ms-swift's per-message "loss":
// false keeps a turn out of the loss, true and absent train it as usual (the empty think block stays
// untrained either way, as with ms-swift's ignore_empty_think).
#include "data/format_test_util.h"

namespace deltamoe {
namespace {

using namespace format_test;

TEST(FormatSystemLoss, TopLevelSystemMatchesASystemMessage) {
  expect_same_as_messages(
      R"({"system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})",
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})");
  const SftSample sample = build(R"({"system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})");
  EXPECT_NE(data_test::qwen3_tokenizer().decode(sample.input_ids).find("<|im_start|>system\nBe brief.<|im_end|>"), std::string::npos);
}

TEST(FormatSystemLoss, LossFalseKeepsATurnOutOfTheLoss) {
  const std::string line =
      R"({"messages": [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi, how can I help?", "loss": false},)"
      R"( {"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "It equals 2", "loss": true}]})";
  const SftSample with_switch = build(line);
  EXPECT_EQ(supervised_text(with_switch), "It equals 2<|im_end|>");
  // The tokens are those of the line without the switches; only the mask differs.
  const SftSample plain = build(
      R"({"messages": [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi, how can I help?"},)"
      R"( {"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "It equals 2"}]})");
  EXPECT_EQ(with_switch.input_ids, plain.input_ids);
  EXPECT_EQ(supervised_text(plain), "Hi, how can I help?<|im_end|> | It equals 2<|im_end|>");
  // loss_scale 0 / 1 (ms-swift >= 4.2) mean the same.
  EXPECT_EQ(supervised_text(build(
                R"({"messages": [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi, how can I help?", "loss_scale": 0},)"
                R"( {"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "It equals 2", "loss_scale": 1}]})")),
            "It equals 2<|im_end|>");
  EXPECT_EQ(skip_of(R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "loss": "no"}]})").reason,
            SkipReason::kBadConversation);
}

TEST(FormatSystemLoss, EveryTurnLossFalseLeavesNothingToTrain) {
  EXPECT_EQ(skip_of(R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "loss": false}]})").reason,
            SkipReason::kNoSupervisedToken);
}

TEST(FormatSystemLoss, NonThinkingPrefixOnEveryTurnAsMsSwiftTrains) {
  const std::string line =
      R"({"messages": [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "a"},)"
      R"( {"role": "user", "content": "B?"}, {"role": "assistant", "content": "b"}]})";
  const std::string plain = data_test::qwen3_tokenizer().decode(build(line).input_ids);
  SampleOptions every_turn = options();
  every_turn.chat_options.think_on_every_turn = true;
  const SftSample sample = build(line, "/", every_turn);
  const std::string text = data_test::qwen3_tokenizer().decode(sample.input_ids);
  EXPECT_EQ(plain.find("<think>"), plain.rfind("<think>")) << "the template: a think block on the last turn only";
  EXPECT_NE(text.find("<|im_start|>assistant\n<think>\n\n</think>\n\na<|im_end|>"), std::string::npos) << text;
  EXPECT_EQ(supervised_text(sample), "a<|im_end|> | b<|im_end|>") << "the empty think blocks stay untrained";
}

}  // namespace
}  // namespace deltamoe
