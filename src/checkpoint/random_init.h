// A randomly initialised model checkpoint with transformers' initialisation (see InitKind in
// model/param_table.h). Tensors are produced lazily while the writer streams them, so even the
// 397B preset can be written without holding it in RAM. Deterministic: a tensor's values depend
// only on (seed, tensor name, element index), not on order, threads or which other tensors exist.
#pragma once

#include <cstdint>

#include "checkpoint/model_checkpoint.h"
#include "core/dtype.h"
#include "model/config.h"

namespace deltamoe {

// `dtype` is bf16 or f32 (A_log is f32 either way, as in the released checkpoints).
ModelCheckpoint random_init_checkpoint(const ModelConfig& config, uint64_t seed, DType dtype);

}  // namespace deltamoe
