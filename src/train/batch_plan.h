// How a global batch is cut into micro-batches: counted in samples (--global_batch_size,
// --micro_batch_size, as ms-swift / Megatron count them) or in tokens (--micro_batch_tokens), and
// how their gradients are weighted so that the split changes no rounding.
#pragma once

#include <cstddef>
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

// The loss weights every micro-batch of one step hands to TrainEngine::forward_backward, and the
// divisor of the summed gradient. The engines differentiate the CE *sum* (ce_token_weight 1: the
// CPU model's per-token weight is then n / n = 1 exactly in any micro-batch of n supervised tokens)
// and the step divides the total by S, its supervised tokens, once. Seeding each micro-batch with
// (1 / S) n instead leaves a per-token weight fl(fl(n / S) / n) that is 1 ulp off fl(1 / S) for some
// n (e.g. 12 of 76), so the split would change the gradient's rounding (docs/training.md).
struct MicroBatchWeights {
  double ce_token_weight = 0;   // 1, or 0 when the step has no supervised token
  double aux_weight = 0;        // aux_coef / micro-batches, times the divisor
  double gradient_divisor = 1;  // S, or 1 when S is 0 (only the aux loss trains)
};
MicroBatchWeights micro_batch_weights(int64_t num_supervised_tokens, int64_t num_micro_batches, double aux_coef);

// grad[i] = grad[i] / divisor, the quotient formed in fp64 and rounded to fp32 (divisor 1: unchanged).
void divide_gradient(float* grad, size_t numel, double divisor);

}  // namespace deltamoe
