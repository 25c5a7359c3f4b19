// Embedding lookup + image-feature scatter + 3-D positions, and the backward through both.
#include "model/vision/multimodal_embedding.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/embedding/embedding.h"
#include "kernels/token_scatter/token_scatter.h"
#include "model/vision/mrope_positions.h"

namespace deltamoe {

MultimodalEmbedding multimodal_embed_forward(const ModelConfig& config, const VisionParams& vision_params,
                                             const float* embed_table, const int64_t* input_ids, int64_t num_tokens,
                                             const std::vector<int32_t>& cu_seqlens, const HostTensor* pixel_values,
                                             const HostTensor* image_grid_thw) {
  const int64_t hidden = config.text.hidden_size;
  CHECK((pixel_values == nullptr) == (image_grid_thw == nullptr),
        "multimodal inputs: pixel_values and image_grid_thw must be given together");
  CHECK(std::find(input_ids, input_ids + num_tokens, config.video_token_id) == input_ids + num_tokens,
        "multimodal inputs: video tokens (id ", config.video_token_id, ") are not supported yet");
  MultimodalEmbedding result;
  result.input_embeds.resize(num_tokens * hidden);
  embedding_forward_ref(input_ids, embed_table, result.input_embeds.data(), num_tokens, config.text.vocab_size, hidden);
  std::vector<GridThw> grids;
  if (pixel_values != nullptr) {
    CHECK(config.has_vision, "multimodal inputs: the batch has images but the model has no vision tower");
    CHECK(config.vision.out_hidden_size == hidden, "vision out_hidden_size ", config.vision.out_hidden_size,
          " differs from the text hidden size ", hidden);
    result.has_images = true;
    result.vision = vision_tower_forward(vision_params, config.vision, *pixel_values, *image_grid_thw);
    const HostTensor& features = result.vision.features;
    token_scatter_forward_ref(input_ids, num_tokens, config.image_token_id, features.as<float>(), features.shape()[0],
                              result.input_embeds.data(), hidden);
    const int64_t* values = image_grid_thw->as<int64_t>();
    for (int64_t i = 0; i < image_grid_thw->shape()[0]; ++i) grids.push_back({values[3 * i], values[3 * i + 1], values[3 * i + 2]});
  }
  result.positions = compute_mrope_positions(input_ids, num_tokens, cu_seqlens, grids, {},
                                             config.vision.spatial_merge_size, config.image_token_id,
                                             config.video_token_id);
  return result;
}

void multimodal_embed_backward(const ModelConfig& config, const VisionParams& vision_params,
                               const MultimodalEmbedding& forward, const int64_t* input_ids, int64_t num_tokens,
                               std::vector<float>& d_input_embeds, float* d_embed_table, VisionParams* vision_grads,
                               const TrainableParts& trainable) {
  const int64_t hidden = config.text.hidden_size;
  CHECK(static_cast<int64_t>(d_input_embeds.size()) == num_tokens * hidden, "multimodal backward: d_input_embeds has ",
        d_input_embeds.size(), " values, expected ", num_tokens * hidden);
  if (forward.has_images && trainable.vision()) {
    const int64_t rows = forward.vision.features.shape()[0];
    HostTensor d_features(DType::f32, Shape{rows, hidden});
    token_scatter_backward_ref(input_ids, num_tokens, config.image_token_id, d_input_embeds.data(),
                               d_features.as<float>(), rows, hidden);
    vision_tower_backward(vision_params, config.vision, forward.vision.saved, d_features, vision_grads, kVisionPrefix,
                          trainable);
  }
  if (d_embed_table == nullptr) return;
  if (forward.has_images && !trainable.vision()) {
    // The scatter's backward above did not run, so the image rows still hold their gradient: they
    // belong to the features, not to the <|image_pad|> embedding row.
    for (int64_t t = 0; t < num_tokens; ++t) {
      if (input_ids[t] == config.image_token_id) std::fill_n(d_input_embeds.data() + t * hidden, hidden, 0.0f);
    }
  }
  embedding_backward_ref(input_ids, d_input_embeds.data(), d_embed_table, num_tokens, config.text.vocab_size, hidden);
}

}  // namespace deltamoe
