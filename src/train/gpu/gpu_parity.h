// `deltamoe parity --device cuda` for text batches: the same inputs and output contract as the CPU
// run_parity_cpu (train/parity.h: ce_loss, aux_loss, logits, grad.<name>, grad_aux.<name>), computed
// by GpuTextModel in bf16 with fp32 accumulation. For cmd_parity to call when --device cuda is given.
#pragma once

#include "checkpoint/model_checkpoint.h"
#include "train/parity.h"

namespace deltamoe {

// Text only (no pixel_values); every text parameter is trained. Throws with a message otherwise.
ParityResult run_parity_gpu(const ModelCheckpoint& checkpoint, const ParityInputs& inputs);

}  // namespace deltamoe
