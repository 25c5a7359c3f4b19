// How a global batch is cut into micro-batches: counted in samples (--global_batch_size,
// --micro_batch_size, as ms-swift / Megatron count them) or in tokens (--micro_batch_tokens).
#pragma once

#include <cstdint>

namespace deltamoe {

struct TrainOptions;

struct BatchPlan {
  int64_t accumulation = 1;         // micro-batches per optimizer step on each data-parallel rank
  int64_t micro_batch_samples = 0;  // samples per micro-batch (0: limited by tokens only)
  int64_t token_budget = 0;         // tokens per micro-batch
  int64_t global_batch_samples = 0; // samples per optimizer step over all ranks (0: counted in tokens)
};

// Resolves the batch flags; throws an error naming the flags when they contradict each other.
// Samples: accumulation = global / (micro x data-parallel ranks), micro defaults to 1, and the
// token budget is micro x max_length so that the sample count alone decides a micro-batch.
// Tokens: accumulation = --gradient_accumulation_steps (default 1), budget --micro_batch_tokens.
BatchPlan plan_batches(const TrainOptions& options);

}  // namespace deltamoe
