// Batch-size flags -> micro-batch shape and accumulation, with the consistency checks; the loss
// weights of a step's micro-batches.
#include "train/batch_plan.h"

#include <cmath>

#include "core/error.h"
#include "train/train_options.h"

namespace deltamoe {

BatchPlan plan_batches(const TrainOptions& options) {
  CHECK(options.global_batch_size >= 0, "--global_batch_size must be >= 0 (0: not counted in samples), got ",
        options.global_batch_size);
  CHECK(options.micro_batch_size >= 0, "--micro_batch_size must be >= 0 (0: not counted in samples), got ",
        options.micro_batch_size);
  CHECK(options.gradient_accumulation_steps >= 0, "--gradient_accumulation_steps must be >= 0 (0: derive it), got ",
        options.gradient_accumulation_steps);
  CHECK(options.data_parallel_size >= 1, "data-parallel size must be >= 1, got ", options.data_parallel_size);
  CHECK(options.max_length > 0, "--max_length must be positive, got ", options.max_length);
  BatchPlan plan;
  const bool in_samples = options.global_batch_size > 0 || options.micro_batch_size > 0;
  if (!in_samples) {
    plan.accumulation = options.gradient_accumulation_steps > 0 ? options.gradient_accumulation_steps : 1;
    plan.token_budget = options.micro_batch_tokens > 0 ? options.micro_batch_tokens : options.max_length;
    return plan;
  }
  // Two limits on one micro-batch would make the number of samples per step depend on their lengths.
  CHECK(options.micro_batch_tokens == 0, "--micro_batch_tokens (", options.micro_batch_tokens,
        ") cannot be combined with --global_batch_size / --micro_batch_size: give the batch in samples or in ",
        "tokens, not both");
  plan.micro_batch_samples = options.micro_batch_size > 0 ? options.micro_batch_size : 1;
  plan.token_budget = plan.micro_batch_samples * options.max_length;
  const int64_t per_micro_step = plan.micro_batch_samples * options.data_parallel_size;
  if (options.global_batch_size > 0) {
    const int64_t global = options.global_batch_size;
    if (global % per_micro_step != 0) {
      const int64_t below = global / per_micro_step * per_micro_step;
      RAISE("--global_batch_size ", global, " is not a multiple of --micro_batch_size ", plan.micro_batch_samples,
            " x ", options.data_parallel_size, " data-parallel rank(s) = ", per_micro_step, "; use ",
            below > 0 ? str_cat(below, " or ") : std::string(), below + per_micro_step, ", or change --micro_batch_size");
    }
    plan.accumulation = global / per_micro_step;
    CHECK(options.gradient_accumulation_steps == 0 || options.gradient_accumulation_steps == plan.accumulation,
          "--gradient_accumulation_steps ", options.gradient_accumulation_steps, " contradicts --global_batch_size ",
          global, " / (--micro_batch_size ", plan.micro_batch_samples, " x ", options.data_parallel_size,
          " data-parallel rank(s)) = ", plan.accumulation, "; give only two of the three");
  } else {
    plan.accumulation = options.gradient_accumulation_steps > 0 ? options.gradient_accumulation_steps : 1;
  }
  plan.global_batch_samples = per_micro_step * plan.accumulation;
  return plan;
}

MicroBatchWeights micro_batch_weights(int64_t num_supervised_tokens, int64_t num_micro_batches, double aux_coef) {
  CHECK(num_supervised_tokens >= 0, "a step cannot have ", num_supervised_tokens, " supervised tokens");
  CHECK(num_micro_batches > 0, "a step needs at least one micro-batch, got ", num_micro_batches);
  CHECK(std::isfinite(aux_coef) && aux_coef >= 0, "--router_aux_loss_coef must be a non-negative number, got ",
        aux_coef);
  MicroBatchWeights weights;
  if (num_supervised_tokens > 0) {
    weights.ce_token_weight = 1.0;
    weights.gradient_divisor = static_cast<double>(num_supervised_tokens);
  }
  // Scaled up by the divisor so that dividing the total leaves aux_coef / micro-batches.
  weights.aux_weight = aux_coef / static_cast<double>(num_micro_batches) * weights.gradient_divisor;
  return weights;
}

void divide_gradient(float* grad, size_t numel, double divisor) {
  CHECK(divisor > 0 && std::isfinite(divisor), "gradient divisor must be positive, got ", divisor);
  if (divisor == 1.0) return;
  for (size_t i = 0; i < numel; ++i) grad[i] = static_cast<float>(static_cast<double>(grad[i]) / divisor);
}

}  // namespace deltamoe
