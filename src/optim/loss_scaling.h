// Loss normalisation over a global batch made of several micro-batches (and data-parallel
// ranks): cross-entropy is summed per token and divided by the global supervised-token count;
// the router aux loss is weighted by its coefficient and averaged over micro-batches.
#pragma once

#include <cstdint>

namespace deltamoe {

// The counts of one global batch = all micro-batches of one optimizer step on all ranks.
struct GlobalBatchCounts {
  int64_t num_supervised_tokens = 0;  // labels != -100 over the whole global batch
  int64_t num_micro_batches = 0;      // forward passes over the whole global batch (all ranks)
};

// The weights the trainer feeds into each micro-batch's backward, and the loss it reports.
//
//   loss = (sum over all micro-batches of CE summed over their supervised tokens) / num_supervised_tokens
//        + aux_coef * (sum over micro-batches of aux) / num_micro_batches
//
// Why: the CE term then equals the token mean of one big batch, whatever the split into
// micro-batches or ranks (a mean of micro-batch means would weight a token of a short micro-batch
// more). The aux loss is a balance statistic of one forward pass, not a per-token sum, so it is
// averaged per forward pass (Megatron does the same: aux scaled by 1 / num_microbatches).
// With data parallelism the gradients are then SUMMED over ranks (not averaged), because both
// denominators already count the whole global batch.
// A global batch without supervised tokens gets CE weight 0 (its CE contributes nothing instead
// of 0/0 = NaN); the trainer should warn about it.
class GlobalBatchLoss {
 public:
  GlobalBatchLoss(const GlobalBatchCounts& counts, double aux_coef);

  // d loss / d (per-token CE) for every supervised token: 1 / num_supervised_tokens (0 if none).
  // The fused cross-entropy backward of every micro-batch is seeded with this.
  double ce_token_weight() const { return ce_token_weight_; }
  // d loss / d (aux loss of one micro-batch): aux_coef / num_micro_batches.
  double aux_weight() const { return aux_weight_; }
  double aux_coef() const { return aux_coef_; }
  const GlobalBatchCounts& counts() const { return counts_; }

  // Records one micro-batch's CE sum (over its supervised tokens) and its aux loss value.
  void add_micro_batch(double ce_sum, int64_t num_supervised_tokens, double aux_loss);
  // Adds partial totals from other ranks (after an all-reduce of the three numbers).
  void add_partial(double ce_sum, int64_t num_supervised_tokens, double aux_sum);

  double ce_sum() const { return ce_sum_; }
  double aux_sum() const { return aux_sum_; }
  int64_t seen_supervised_tokens() const { return seen_tokens_; }
  // The token-mean CE of the global batch (what users compare with HF's loss).
  double ce_loss() const { return ce_sum_ * ce_token_weight_; }
  // aux_coef * mean aux over micro-batches.
  double weighted_aux_loss() const { return aux_sum_ * aux_weight_; }
  // ce_loss() + weighted_aux_loss(): the objective whose gradient the backward passes produce.
  double total_loss() const { return ce_loss() + weighted_aux_loss(); }

 private:
  GlobalBatchCounts counts_;
  double aux_coef_;
  double ce_token_weight_;
  double aux_weight_;
  double ce_sum_ = 0;
  double aux_sum_ = 0;
  int64_t seen_tokens_ = 0;
};

}  // namespace deltamoe
