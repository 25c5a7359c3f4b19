// GlobalBatchLoss: the per-token and per-micro-batch weights and the reported loss.
#include "optim/loss_scaling.h"

#include <cmath>

#include "core/error.h"

namespace deltamoe {

GlobalBatchLoss::GlobalBatchLoss(const GlobalBatchCounts& counts, double aux_coef)
    : counts_(counts), aux_coef_(aux_coef) {
  CHECK(counts.num_supervised_tokens >= 0, "GlobalBatchLoss: negative supervised-token count ",
        counts.num_supervised_tokens);
  CHECK(counts.num_micro_batches > 0, "GlobalBatchLoss: a global batch needs at least one micro-batch, got ",
        counts.num_micro_batches);
  CHECK(std::isfinite(aux_coef) && aux_coef >= 0, "--router_aux_loss_coef must be a non-negative number, got ",
        aux_coef);
  ce_token_weight_ = counts.num_supervised_tokens > 0 ? 1.0 / static_cast<double>(counts.num_supervised_tokens) : 0.0;
  aux_weight_ = aux_coef / static_cast<double>(counts.num_micro_batches);
}

void GlobalBatchLoss::add_micro_batch(double ce_sum, int64_t num_supervised_tokens, double aux_loss) {
  add_partial(ce_sum, num_supervised_tokens, aux_loss);
}

void GlobalBatchLoss::add_partial(double ce_sum, int64_t num_supervised_tokens, double aux_sum) {
  CHECK(num_supervised_tokens >= 0, "GlobalBatchLoss: negative supervised-token count ", num_supervised_tokens);
  ce_sum_ += ce_sum;
  aux_sum_ += aux_sum;
  seen_tokens_ += num_supervised_tokens;
  CHECK(seen_tokens_ <= counts_.num_supervised_tokens, "GlobalBatchLoss: micro-batches hold ", seen_tokens_,
        " supervised tokens, more than the ", counts_.num_supervised_tokens,
        " counted for the global batch (the count must be taken over the same micro-batches)");
}

}  // namespace deltamoe
