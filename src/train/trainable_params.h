// Which parameters a run trains (--freeze_vit / --freeze_aligner / --freeze_llm) and the flat fp32
// master buffer that holds them; and the way back: a checkpoint whose trainable tensors are the
// master weights rounded to each tensor's on-disk dtype (what a save writes).
#pragma once

#include <string>
#include <vector>

#include "checkpoint/model_checkpoint.h"
#include "optim/param_layout.h"

namespace deltamoe {

// ms-swift's defaults: the vision tower and the merger (aligner) frozen, the language model trained.
struct FreezeOptions {
  bool freeze_vit = true;
  bool freeze_aligner = true;
  bool freeze_llm = false;
};

enum class ParamGroup { llm, vit, aligner };
// model.visual.merger.* is the aligner, other model.visual.* the ViT, everything else the LLM.
ParamGroup param_group(const std::string& name);

struct TrainableParams {
  ParamLayout layout;          // trainable tensors, in name order; rank >= 2 decays (docs/optimizer.md)
  std::vector<float> master;   // layout.total_numel() fp32 values (padding zero)
};

// Throws when nothing is left to train (every group frozen, or a text model with only the LLM frozen).
TrainableParams build_trainable_params(const ModelCheckpoint& checkpoint, const FreezeOptions& freeze);

// A copy of base whose trainable tensors are the master values, converted to the dtype each tensor
// had on disk (bf16 checkpoints stay bf16); frozen and passthrough tensors are base's own.
ModelCheckpoint checkpoint_with_master(const ModelCheckpoint& base, const ParamLayout& layout, const float* master);

}  // namespace deltamoe
