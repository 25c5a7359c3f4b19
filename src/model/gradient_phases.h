// The order in which a backward pass finishes the parameter gradients: the loss head (lm_head and
// the final norm), the decoder layers from last to first, the token embedding, then the vision
// tower (merger, blocks from last to first, patch and position embedding). Each phase names its
// tensors by prefix; the GPU models report each phase as it completes (GradientReadyHook), so a
// parallel run can reduce-scatter that phase's gradients while the backward goes on and reuse their
// memory for the next phase.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/config.h"

namespace deltamoe {

enum class GradientPhaseKind : uint8_t { text_head, text_layer, text_embedding, vision_merger, vision_block, vision_input };

struct GradientPhaseId {
  GradientPhaseKind kind = GradientPhaseKind::text_head;
  int64_t index = 0;  // the layer or block of text_layer / vision_block, else 0
  bool operator==(const GradientPhaseId& other) const { return kind == other.kind && index == other.index; }
};

struct GradientPhase {
  GradientPhaseId id;
  std::vector<std::string> prefixes;  // a tensor belongs to the phase when its name starts with one
  bool contains(const std::string& name) const;
};

// Called by a model's backward when every gradient of a phase is final for this micro-batch.
using GradientReadyHook = std::function<void(GradientPhaseId)>;

// The phases of `config` in backward order (the vision ones only with a vision tower).
std::vector<GradientPhase> backward_gradient_phases(const ModelConfig& config);

// "layer 12", "lm_head and final norm", ...: for messages.
std::string gradient_phase_name(GradientPhaseId id);

}  // namespace deltamoe
