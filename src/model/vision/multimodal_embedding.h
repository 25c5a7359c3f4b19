// The VLM's input side in one place: token embeddings with the vision tower's features written into the
// <|image_pad|> rows, the 3-D (t, h, w) positions, and the backward that splits the embedding gradient
// between embed_tokens and the vision tower (transformers' get_rope_index and masked_scatter of image
// features). Images only (no video yet). Legend: T tokens, C text hidden, V vocabulary.
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/vision/vision_tower.h"

namespace deltamoe {

struct MultimodalEmbedding {
  std::vector<float> input_embeds;  // [T, C]
  std::vector<int64_t> positions;   // [3, T] rows t, h, w
  bool has_images = false;
  VisionTowerOutput vision;         // features [M, C] and saved activations (when has_images)
};

// embed_table [V, C] f32; input_ids [T]; cu_seqlens int32 [S+1] (samples; positions restart in each).
// pixel_values f32 [N, 1536] and image_grid_thw int64 [I, 3] may both be null (text only).
MultimodalEmbedding multimodal_embed_forward(const ModelConfig& config, const VisionParams& vision_params,
                                             const float* embed_table, const int64_t* input_ids, int64_t num_tokens,
                                             const std::vector<int32_t>& cu_seqlens, const HostTensor* pixel_values,
                                             const HostTensor* image_grid_thw);

// d_input_embeds [T, C] from the text model; its image rows are moved to the vision tower (and
// zeroed here). d_embed_table [V, C] and vision_grads (by HF name) are added to. Freezing: a null
// d_embed_table skips the table's gradient (frozen LLM); with neither ViT nor merger trainable the
// vision backward does not run at all, otherwise vision_tower_backward skips the frozen part.
void multimodal_embed_backward(const ModelConfig& config, const VisionParams& vision_params,
                               const MultimodalEmbedding& forward, const int64_t* input_ids, int64_t num_tokens,
                               std::vector<float>& d_input_embeds, float* d_embed_table, VisionParams* vision_grads,
                               const TrainableParts& trainable = {});

}  // namespace deltamoe
