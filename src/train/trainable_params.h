// Which parameters a run trains (--freeze_vit / --freeze_aligner / --freeze_llm) as the layout of
// the training state, and the way back for a save: a checkpoint whose trained tensors are the
// state's master weights rounded to each tensor's on-disk dtype, produced while the writer streams.
#pragma once

#include <string>

#include "checkpoint/model_checkpoint.h"
#include "model/lora/lora_adapters.h"
#include "optim/param_layout.h"
#include "optim/train_state.h"

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
bool is_frozen(const std::string& name, const FreezeOptions& freeze);

// The trained tensors of checkpoint, whole, in name order; rank >= 2 decays (docs/optimizer.md).
// Throws when nothing is left to train.
ParamLayout trainable_layout(const ModelCheckpoint& checkpoint, const FreezeOptions& freeze);

// LoRA: the adapters' A and B, then the --modules_to_save parameters (shapes from checkpoint), in
// lora.trained_names() order.
ParamLayout lora_layout(const ModelCheckpoint& checkpoint, const LoraAdapters& lora);

// lora with every trained tensor's value read from the state's master weights (for a save).
LoraAdapters lora_adapters_from_state(const LoraAdapters& lora, const TrainStateStore& state);

// A copy of base whose trained tensors read the state's master weights when written, converted to
// the dtype each tensor had on disk (bf16 checkpoints stay bf16, rounded as the working weights
// are: ties away from zero, so the file holds the weights training computed with); frozen and
// passthrough tensors are base's own. On one rank the state holds every trained tensor whole; on a
// rank of several it holds pieces (tensor, element range), and reading elements it does not hold
// throws (each rank writes only its own byte ranges: train/rank_checkpoint.h). The copy refers to
// state: keep it alive and unchanged until the save is done.
ModelCheckpoint checkpoint_with_state(const ModelCheckpoint& base, const TrainStateStore& state);

}  // namespace deltamoe
