// Tests of the global-batch loss rule: CE over unequal micro-batches equals the token mean of
// one big batch (and differs from the mean of micro-batch means), the weights are the exact
// derivatives, aux is coefficient-weighted and averaged per micro-batch, ranks combine.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "optim/loss_scaling.h"

namespace deltamoe {
namespace {

// Per-token CE values of micro-batches of different sizes (one is empty).
std::vector<std::vector<double>> make_micro_batches() {
  Rng rng(11);
  std::vector<std::vector<double>> batches;
  for (int size : {3, 50, 0, 17, 1}) {
    std::vector<double> tokens;
    for (int i = 0; i < size; ++i) tokens.push_back(0.5 + 4.0 * rng.uniform_f64());
    batches.push_back(tokens);
  }
  return batches;
}

TEST(GlobalBatchLoss, CeIsTheTokenMeanOfTheWholeGlobalBatch) {
  const auto batches = make_micro_batches();
  int64_t num_tokens = 0;
  double all_tokens_sum = 0, mean_of_means = 0;
  int num_nonempty = 0;
  for (const auto& batch : batches) {
    double batch_sum = 0;
    for (double value : batch) batch_sum += value;
    num_tokens += static_cast<int64_t>(batch.size());
    all_tokens_sum += batch_sum;
    if (!batch.empty()) {
      mean_of_means += batch_sum / static_cast<double>(batch.size());
      ++num_nonempty;
    }
  }
  mean_of_means /= num_nonempty;
  const double token_mean = all_tokens_sum / static_cast<double>(num_tokens);

  GlobalBatchLoss loss({num_tokens, static_cast<int64_t>(batches.size())}, 0.0);
  for (const auto& batch : batches) {
    double batch_sum = 0;
    for (double value : batch) batch_sum += value;
    loss.add_micro_batch(batch_sum, static_cast<int64_t>(batch.size()), 0.0);
  }
  const double error = std::fabs(loss.ce_loss() - token_mean);
  std::printf("global CE %.12f vs token mean %.12f (abs error %.3g); mean of micro-batch means %.6f\n",
              loss.ce_loss(), token_mean, error, mean_of_means);
  EXPECT_LT(error, 1e-12);
  EXPECT_GT(std::fabs(mean_of_means - token_mean), 1e-3);  // the rule matters for this split
  EXPECT_EQ(loss.seen_supervised_tokens(), num_tokens);
}

TEST(GlobalBatchLoss, WeightsAreTheDerivativesOfTheReportedLoss) {
  // total = sum(ce) / N + coef * sum(aux) / M is linear, so a finite difference in one token's
  // CE or one micro-batch's aux must equal the weights handed to the backward.
  const GlobalBatchCounts counts{71, 5};
  const double coef = 0.001;
  auto total_loss = [&](double ce_bump, double aux_bump) {
    GlobalBatchLoss loss(counts, coef);
    loss.add_micro_batch(100.0 + ce_bump, 40, 1.3 + aux_bump);
    loss.add_micro_batch(55.0, 31, 1.1);
    return loss.total_loss();
  };
  const double h = 1e-3;
  const double d_ce = (total_loss(h, 0) - total_loss(-h, 0)) / (2 * h);
  const double d_aux = (total_loss(0, h) - total_loss(0, -h)) / (2 * h);
  GlobalBatchLoss loss(counts, coef);
  std::printf("d/dCE %.12g vs weight %.12g; d/daux %.12g vs weight %.12g\n", d_ce, loss.ce_token_weight(), d_aux,
              loss.aux_weight());
  EXPECT_NEAR(d_ce, 1.0 / 71, 1e-10);
  EXPECT_NEAR(loss.ce_token_weight(), 1.0 / 71, 1e-18);
  EXPECT_NEAR(d_aux, coef / 5, 1e-10);
  EXPECT_NEAR(loss.aux_weight(), coef / 5, 1e-18);
}

TEST(GlobalBatchLoss, AuxIsCoefficientTimesMicroBatchMean) {
  GlobalBatchLoss loss({10, 4}, 0.01);
  const double aux[] = {1.0, 1.5, 2.0, 3.5};
  for (double value : aux) loss.add_micro_batch(0.0, 0, value);
  const double expected = 0.01 * (1.0 + 1.5 + 2.0 + 3.5) / 4;
  EXPECT_NEAR(loss.weighted_aux_loss(), expected, 1e-15);
  EXPECT_NEAR(loss.total_loss(), expected, 1e-15);
}

TEST(GlobalBatchLoss, RanksCombineByPartialSums) {
  // Two ranks of two micro-batches each: summing per-rank partials gives the single-process value.
  GlobalBatchLoss single({60, 4}, 0.1);
  single.add_micro_batch(10.0, 10, 1.0);
  single.add_micro_batch(20.0, 20, 2.0);
  single.add_micro_batch(5.0, 5, 3.0);
  single.add_micro_batch(25.0, 25, 4.0);
  GlobalBatchLoss combined({60, 4}, 0.1);
  combined.add_partial(10.0 + 20.0, 30, 1.0 + 2.0);
  combined.add_partial(5.0 + 25.0, 30, 3.0 + 4.0);
  EXPECT_DOUBLE_EQ(single.total_loss(), combined.total_loss());
  EXPECT_DOUBLE_EQ(single.ce_loss(), 1.0);
}

TEST(GlobalBatchLoss, EmptyAndInconsistentCounts) {
  GlobalBatchLoss empty({0, 2}, 0.0);
  EXPECT_EQ(empty.ce_token_weight(), 0.0);
  empty.add_micro_batch(0.0, 0, 0.0);
  EXPECT_EQ(empty.ce_loss(), 0.0);  // not NaN
  GlobalBatchLoss loss({5, 1}, 0.0);
  EXPECT_THROW(loss.add_micro_batch(1.0, 6, 0.0), Error);  // more tokens than counted
  EXPECT_THROW(GlobalBatchLoss({5, 0}, 0.0), Error);
  EXPECT_THROW(GlobalBatchLoss({5, 1}, -1.0), Error);
}

}  // namespace
}  // namespace deltamoe
