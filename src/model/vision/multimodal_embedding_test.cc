// multimodal_embed_forward/backward on the text-only path and its input checks (the image path is
// compared with transformers in src/cli/vlm_vision_golden_test.cc).
#include "model/vision/multimodal_embedding.h"

#include <gtest/gtest.h>

#include "core/error.h"
#include "model/config.h"

namespace deltamoe {
namespace {

TEST(MultimodalEmbedding, TextOnlyIsALookupWithTextPositions) {
  ModelConfig config = model_config_preset("tiny-vl");
  const int64_t vocab = config.text.vocab_size, hidden = config.text.hidden_size;
  std::vector<float> table(vocab * hidden);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<float>(i % 97) * 0.01f;
  const std::vector<int64_t> ids = {3, 1, 4, 1, 5};
  const MultimodalEmbedding embedding =
      multimodal_embed_forward(config, {}, table.data(), ids.data(), 5, {0, 2, 5}, nullptr, nullptr);
  EXPECT_FALSE(embedding.has_images);
  EXPECT_EQ(embedding.input_embeds[2 * hidden + 7], table[4 * hidden + 7]);
  for (int axis = 0; axis < 3; ++axis) {
    EXPECT_EQ(std::vector<int64_t>(embedding.positions.begin() + axis * 5, embedding.positions.begin() + axis * 5 + 5),
              (std::vector<int64_t>{0, 1, 0, 1, 2}));
  }
  // Backward: token 1 appears twice, so its table row gets both rows' gradient.
  std::vector<float> d_embeds(5 * hidden, 1.0f), d_table(vocab * hidden, 0.0f);
  multimodal_embed_backward(config, {}, embedding, ids.data(), 5, d_embeds, d_table.data(), nullptr);
  EXPECT_EQ(d_table[1 * hidden], 2.0f);
  EXPECT_EQ(d_table[3 * hidden], 1.0f);
  EXPECT_EQ(d_table[2 * hidden], 0.0f);
}

TEST(MultimodalEmbedding, RejectsInconsistentInputs) {
  ModelConfig config = model_config_preset("tiny-vl");
  std::vector<float> table(config.text.vocab_size * config.text.hidden_size);
  const std::vector<int64_t> video = {1, config.video_token_id, 2};
  EXPECT_THROW(multimodal_embed_forward(config, {}, table.data(), video.data(), 3, {0, 3}, nullptr, nullptr), Error);
  const HostTensor pixels(DType::f32, Shape{4, 1536});
  const std::vector<int64_t> text = {1, 2, 3};
  EXPECT_THROW(multimodal_embed_forward(config, {}, table.data(), text.data(), 3, {0, 3}, &pixels, nullptr), Error);
}

}  // namespace
}  // namespace deltamoe
