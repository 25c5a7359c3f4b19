// Phase lists by tensor-name prefix (see the header); the names are the parameter table's.
#include "model/gradient_phases.h"

#include "core/error.h"
#include "model/vision/vision_tower.h"

namespace deltamoe {

bool GradientPhase::contains(const std::string& name) const {
  for (const std::string& prefix : prefixes)
    if (name.compare(0, prefix.size(), prefix) == 0) return true;
  return false;
}

std::vector<GradientPhase> backward_gradient_phases(const ModelConfig& config) {
  const std::string text = config.text_prefix() + ".";
  const std::string vision = std::string(kVisionPrefix) + ".";
  std::vector<GradientPhase> phases;
  phases.push_back({{GradientPhaseKind::text_head, 0}, {"lm_head.", text + "norm."}});
  for (int64_t i = config.text.num_hidden_layers - 1; i >= 0; --i)
    phases.push_back({{GradientPhaseKind::text_layer, i}, {str_cat(text, "layers.", i, ".")}});
  phases.push_back({{GradientPhaseKind::text_embedding, 0}, {text + "embed_tokens."}});
  if (config.has_vision) {
    phases.push_back({{GradientPhaseKind::vision_merger, 0}, {vision + "merger."}});
    for (int64_t j = config.vision.depth - 1; j >= 0; --j)
      phases.push_back({{GradientPhaseKind::vision_block, j}, {str_cat(vision, "blocks.", j, ".")}});
    phases.push_back({{GradientPhaseKind::vision_input, 0}, {vision + "patch_embed.", vision + "pos_embed."}});
  }
  return phases;
}

std::string gradient_phase_name(GradientPhaseId id) {
  switch (id.kind) {
    case GradientPhaseKind::text_head: return "lm_head and final norm";
    case GradientPhaseKind::text_layer: return str_cat("decoder layer ", id.index);
    case GradientPhaseKind::text_embedding: return "token embedding";
    case GradientPhaseKind::vision_merger: return "vision merger";
    case GradientPhaseKind::vision_block: return str_cat("vision block ", id.index);
    case GradientPhaseKind::vision_input: return "vision patch and position embedding";
  }
  return "?";
}

}  // namespace deltamoe
