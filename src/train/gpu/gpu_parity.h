// `deltamoe parity --device cuda`: the same inputs and output contract as the CPU run_parity_cpu
// (train/parity.h: ce_loss, aux_loss, logits, grad.<name>, grad_aux.<name> for text and vision
// tensors, frozen parts left out), computed by GpuTextModel and, with images, GpuVisionModel in
// bf16 with fp32 accumulation.
#pragma once

#include "checkpoint/model_checkpoint.h"
#include "model/vision/trainable_parts.h"
#include "train/parity.h"

namespace deltamoe {

// Text, or images through the GPU vision tower (vision forward -> scatter into the <|image_pad|>
// rows -> text forward/backward -> vision backward). Freezing as run_parity_cpu: frozen parts get
// no gradient entries. Throws with a message on inputs the CPU run would also refuse.
ParityResult run_parity_gpu(const ModelCheckpoint& checkpoint, const ParityInputs& inputs,
                            const TrainableParts& trainable = {});

}  // namespace deltamoe
