// Which parts of the VLM receive parameter gradients; the rest is frozen and the backward skips the
// work that only frozen parts need (no vision backward at all when the whole tower is frozen).
// The names follow ms-swift: vit (the tower), aligner (its merger), llm (the language model).
#pragma once

namespace deltamoe {

struct TrainableParts {
  bool vit = true;      // model.visual.* except the merger: patch/pos embedding and the blocks
  bool aligner = true;  // model.visual.merger.*
  bool llm = true;      // the language model, embed_tokens and lm_head included
  // false under LoRA: the parts' own weights stay frozen and only the tensors the caller put in the
  // gradient map (adapters, --modules_to_save) receive gradients.
  bool base_weights = true;

  // The vision backward runs only when some part of the tower is trained.
  bool vision() const { return vit || aligner; }
};

}  // namespace deltamoe
