// The CPU engine on several ranks (ThreadComm) against one rank: with expert
// parallelism the logits, CE and aux losses of every micro-batch and the experts' gradients are
// bitwise those of one rank running the same micro-batches in order (g, rank); with ZeRO-2 the dense
// gradients, the gradient norm and the AdamW master after 3 steps are bitwise those of a one-rank
// emulation of the data-parallel sums (one gradient per emulated rank and micro-batch, summed in
// rank order, sharded the same way), and within a small tolerance of the plain one-rank step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>

#include "checkpoint/random_init.h"
#include "core/rng.h"
#include "model/config.h"
#include "model/vision/mrope_positions.h"
#include "optim/grad_clip.h"
#include "parallel/thread_comm.h"
#include "train/batch_plan.h"
#include "train/cpu_engine.h"
#include "train/parallel_test_util.h"

namespace deltamoe {
namespace {

using namespace parallel_test;

int64_t count_unequal(const float* a, const float* b, int64_t n) {
  int64_t unequal = 0;
  for (int64_t i = 0; i < n; ++i) unequal += std::memcmp(a + i, b + i, sizeof(float)) != 0;
  return unequal;
}

// §4.2 forward and expert rows: every micro-batch's logits, CE and aux loss, and the running expert
// gradients after all micro-batches, from ranks of an EP job vs one rank running them in order.
void expect_expert_parallel_matches_one_rank(const std::string& preset, bool images, int ep, int64_t accumulation) {
  SCOPED_TRACE(str_cat(preset, images ? " with images" : "", ", EP ", ep, ", accumulation ", accumulation));
  const Setup setup = make_setup(preset, images, false, ep * accumulation, 1);
  const double ce_weight = 1.0, aux_weight = 0.01;
  CpuEngine one(setup.checkpoint, setup.options);
  const ParamLayout& full = one.full_layout();
  std::vector<std::vector<float>> logits(setup.batches.size());
  std::vector<MicroBatchLoss> losses(setup.batches.size());
  std::vector<float> grad(static_cast<size_t>(full.total_numel()), 0.0f);
  for (size_t m = 0; m < setup.batches.size(); ++m) {
    losses[m] = one.evaluate(setup.batches[m], &logits[m]);
    one.forward_backward(setup.batches[m], ce_weight, aux_weight, grad.data());
  }
  std::mutex mutex;
  int64_t compared_logits = 0, compared_expert = 0, unequal = 0;
  ParallelOptions parallel;
  parallel.expert_parallel_size = ep;
  parallel.distributed_optimizer = true;
  run_thread_comm(ep, [&](Communicator& comm) {
    CpuEngine engine(setup.checkpoint, setup.options, &comm, parallel);
    std::vector<float> mine(static_cast<size_t>(engine.full_layout().total_numel()), 0.0f);
    int64_t my_logits = 0, my_expert = 0, my_unequal = 0;
    for (int64_t g = 0; g < accumulation; ++g) {
      const size_t m = static_cast<size_t>(g * ep + comm.rank());
      std::vector<float> got;
      const MicroBatchLoss loss = engine.evaluate(setup.batches[m], &got);
      EXPECT_EQ(loss.ce_sum, losses[m].ce_sum) << "micro-batch " << m;
      EXPECT_EQ(loss.aux_loss, losses[m].aux_loss) << "micro-batch " << m;
      EXPECT_EQ(got.size(), logits[m].size());
      my_unequal += count_unequal(got.data(), logits[m].data(), static_cast<int64_t>(got.size()));
      my_logits += static_cast<int64_t>(got.size());
      const MicroBatchLoss again = engine.forward_backward(setup.batches[m], ce_weight, aux_weight, mine.data());
      EXPECT_EQ(again.ce_sum, losses[m].ce_sum);
    }
    const ParallelLayout& layout = *engine.parallel_layout();
    EXPECT_FALSE(layout.expert_pieces().empty());
    for (const auto& [state_index, full_index] : layout.expert_pieces()) {
      const ParamEntry& piece = layout.state().entry(state_index);
      const int64_t at = full.entry(full_index).offset + piece.tensor_begin;
      my_unequal += count_unequal(mine.data() + at, grad.data() + at, piece.numel);
      my_expert += piece.numel;
      // A control: the experts received gradient at all.
      double norm = 0;
      for (int64_t i = 0; i < piece.numel; ++i) norm += std::fabs(mine[at + i]);
      EXPECT_GT(norm, 0.0) << piece.name << " rank " << comm.rank();
    }
    std::lock_guard<std::mutex> lock(mutex);
    compared_logits += my_logits, compared_expert += my_expert, unequal += my_unequal;
  });
  std::printf("  %s%s EP %d GA %lld: %lld logits and %lld expert-gradient elements compared, %lld not bitwise equal\n",
              preset.c_str(), images ? " (images)" : "", ep, static_cast<long long>(accumulation),
              static_cast<long long>(compared_logits), static_cast<long long>(compared_expert),
              static_cast<long long>(unequal));
  EXPECT_EQ(unequal, 0);
  EXPECT_GT(compared_expert, 0);
}

TEST(CpuEngineParallel, ExpertParallelForwardAndExpertGradientsEqualOneRank) {
  for (const int ep : {2, 4}) {
    expect_expert_parallel_matches_one_rank("tiny", false, ep, 1);
    expect_expert_parallel_matches_one_rank("tiny-vl", true, ep, 2);
  }
}

// One rank emulating N ranks of ZeRO-2 (+ EP when ep > 1): each emulated rank's gradient of each
// micro-batch is formed alone (the experts' as running totals), bucket pieces are summed over the
// emulated ranks in rank order per micro-batch and added to that rank's shard, the fp64 partial sums
// of squares are added in rank order, and each emulated rank's AdamW updates its own pieces.
class DataParallelEmulation {
 public:
  DataParallelEmulation(const Setup& setup, int world, const ParallelOptions& parallel)
      : one_(setup.checkpoint, setup.options), world_(world), ep_(parallel.expert_parallel_size) {
    for (int r = 0; r < world; ++r) {
      layouts_.push_back(std::make_unique<ParallelLayout>(one_.full_layout(), r, world,
                                                          setup.checkpoint.config.text.num_experts, parallel));
      states_.push_back(std::make_unique<HostTrainState>(layouts_[r]->state(), setup.options.adamw));
      for_each_piece(r, [&](float* piece, const float* full, int64_t n) { std::memcpy(piece, full, n * 4); },
                     states_[r]->master().data(), one_.state().master().data());
    }
    aux_coef_ = setup.options.aux_coef;
  }

  StepResult step(const std::vector<MicroBatch>& batches, double lr, double max_grad_norm) {
    const ParamLayout& full = one_.full_layout();
    const int64_t local = static_cast<int64_t>(batches.size()) / world_;
    StepResult result;
    result.num_micro_batches = static_cast<int64_t>(batches.size());
    for (const MicroBatch& batch : batches) result.num_supervised += batch.num_supervised;
    const MicroBatchWeights weights = micro_batch_weights(result.num_supervised, result.num_micro_batches, aux_coef_);
    grads_.assign(world_, {});
    for (int r = 0; r < world_; ++r) grads_[r].assign(static_cast<size_t>(layouts_[r]->state().total_numel()), 0.0f);
    // One running gradient per expert-parallel group (its experts' totals over its micro-batches).
    const int groups = world_ / ep_;
    std::vector<std::vector<float>> running(groups, std::vector<float>(static_cast<size_t>(full.total_numel()), 0.0f));
    for (int64_t g = 0; g < local; ++g) {
      std::vector<std::vector<float>> rank_grad(world_);
      for (int r = 0; r < world_; ++r) {
        std::vector<float>& group = running[r / ep_];
        for (const int index : layouts_[0]->dense_entries()) {
          const ParamEntry& entry = full.entry(index);
          std::fill(group.begin() + entry.offset, group.begin() + entry.offset + entry.numel, 0.0f);
        }
        const MicroBatchLoss part =
            one_.forward_backward(batches[g * world_ + r], weights.ce_token_weight, weights.aux_weight, group.data());
        result.ce_sum += part.ce_sum;
        result.aux_loss_sum += part.aux_loss;
        rank_grad[r] = group;
      }
      for (int b = 0; b < layouts_[0]->num_buckets(); ++b) {
        const int64_t n = layouts_[0]->piece_elements(b);
        std::vector<std::vector<float>> packed(world_, std::vector<float>(static_cast<size_t>(n * world_)));
        for (int r = 0; r < world_; ++r) layouts_[0]->pack_bucket(b, rank_grad[r].data(), packed[r].data());
        for (int p = 0; p < world_; ++p) {
          std::vector<float> sum(packed[0].begin() + p * n, packed[0].begin() + (p + 1) * n);
          for (int r = 1; r < world_; ++r)
            for (int64_t i = 0; i < n; ++i) sum[i] += packed[r][p * n + i];
          for (const auto& own : layouts_[p]->own_piece_in_state(b)) {
            for (int64_t i = 0; i < own.count; ++i) grads_[p][own.state_offset + i] += sum[own.in_piece + i];
          }
        }
      }
    }
    for (int r = 0; r < world_; ++r) {
      for (const auto& [state_index, full_index] : layouts_[r]->expert_pieces()) {
        // The replicas' totals summed in rank order (group 0, 1, ...).
        const ParamEntry& piece = layouts_[r]->state().entry(state_index);
        const int64_t at = full.entry(full_index).offset + piece.tensor_begin;
        float* out = grads_[r].data() + piece.offset;
        std::copy(running[0].begin() + at, running[0].begin() + at + piece.numel, out);
        for (int q = 1; q < groups; ++q)
          for (int64_t i = 0; i < piece.numel; ++i) out[i] += running[q][at + i];
      }
    }
    double sum_of_squares = 0;
    for (int r = 0; r < world_; ++r) {
      divide_gradient(grads_[r].data(), grads_[r].size(), weights.gradient_divisor);
      // Replicated expert pieces count once, on their first replica.
      const int64_t from = r < ep_ ? 0 : layouts_[r]->dense_state_begin();
      const double partial =
          sum_of_squares_f64(grads_[r].data() + from, static_cast<int64_t>(grads_[r].size()) - from);
      sum_of_squares = r == 0 ? partial : sum_of_squares + partial;
    }
    const GradClipResult clip = grad_clip_from_sum_of_squares(sum_of_squares, max_grad_norm);
    result.grad_norm = clip.grad_norm;
    result.clip_coef = clip.clip_coef;
    for (int r = 0; r < world_; ++r) {
      if (clip.clipped()) scale_in_place(grads_[r].data(), static_cast<int64_t>(grads_[r].size()), clip.clip_coef);
      states_[r]->optimizer().step(lr, states_[r]->master().data(), grads_[r].data());
      for_each_piece(r, [&](float* piece, float* full_values, int64_t n) { std::memcpy(full_values, piece, n * 4); },
                     states_[r]->master().data(), one_.state().master().data());
    }
    one_.state().state_restored();  // the one-rank model now computes with the emulated weights
    return result;
  }

  const std::vector<float>& gradient(int r) const { return grads_[r]; }
  const std::vector<float>& master(int r) const { return states_[r]->master(); }

 private:
  // fn(piece values, the same elements in the full layout, count) for every piece of rank r.
  template <typename Fn, typename P, typename F>
  void for_each_piece(int r, Fn fn, P* pieces, F* full_values) {
    const ParamLayout& full = one_.full_layout();
    for (const ParamEntry& piece : layouts_[r]->state().entries()) {
      const ParamEntry& whole = full.entry(full.find(piece.name));
      fn(pieces + piece.offset, full_values + whole.offset + piece.tensor_begin, piece.numel);
    }
  }

  CpuEngine one_;
  int world_;
  int ep_;  // ranks of one expert-parallel group; world / ep_ groups replicate the experts
  double aux_coef_ = 0;
  std::vector<std::unique_ptr<ParallelLayout>> layouts_;
  std::vector<std::unique_ptr<HostTrainState>> states_;
  std::vector<std::vector<float>> grads_;
};

double l2_relative(const float* a, const float* b, int64_t n) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// §4.2 ZeRO-2 rows: 3 steps on `world` ranks vs the emulation (bitwise: losses, norm, each rank's
// gradient and master) and vs the plain one-rank run (step-0 gradient within 1e-6, master after
// each step within 1e-4, L2 relative over each rank's pieces).
void expect_zero2_matches_emulation(const std::string& preset, bool images, bool freeze_vit, int world, int ep,
                                    int64_t accumulation) {
  SCOPED_TRACE(str_cat(preset, images ? " with images" : "", freeze_vit ? ", frozen ViT" : "", ", world ", world,
                       ", EP ", ep, ", accumulation ", accumulation));
  constexpr int kSteps = 3;
  const int64_t per_step = world * accumulation;
  const Setup setup = make_setup(preset, images, freeze_vit, per_step, kSteps);
  ParallelOptions parallel;
  parallel.expert_parallel_size = ep;
  parallel.distributed_optimizer = true;
  parallel.bucket_elements = 40000;  // several buckets, pieces that span tensors
  const double lr = 2e-3, max_grad_norm = 0.5;
  DataParallelEmulation emulation(setup, world, parallel);
  CpuEngine plain(setup.checkpoint, setup.options);
  std::vector<StepResult> want(kSteps);
  std::vector<std::vector<std::vector<float>>> want_grad(kSteps), want_master(kSteps);
  std::vector<std::vector<float>> plain_grad(kSteps), plain_master(kSteps);
  for (int s = 0; s < kSteps; ++s) {
    const std::vector<MicroBatch> step(setup.batches.begin() + s * per_step, setup.batches.begin() + (s + 1) * per_step);
    want[s] = emulation.step(step, lr, max_grad_norm);
    plain.train_step(step, lr, max_grad_norm);
    plain_grad[s] = plain.step_gradient();
    plain_master[s] = plain.state().master();
    for (int r = 0; r < world; ++r) {
      want_grad[s].push_back(emulation.gradient(r));
      want_master[s].push_back(emulation.master(r));
    }
  }
  std::mutex mutex;
  int64_t unequal = 0, compared = 0, buckets = 0;
  double worst_grad = 0, worst_master = 0;
  bool clipped = false;
  run_thread_comm(world, [&](Communicator& comm) {
    const int r = comm.rank();
    CpuEngine engine(setup.checkpoint, setup.options, &comm, parallel);
    const ParallelLayout& layout = *engine.parallel_layout();
    const ParamLayout& full = engine.full_layout();
    int64_t my_unequal = 0, my_compared = 0;
    double my_grad = 0, my_master = 0;
    bool my_clipped = false;
    for (int s = 0; s < kSteps; ++s) {
      std::vector<MicroBatch> mine;
      for (int64_t g = 0; g < accumulation; ++g) mine.push_back(setup.batches[s * per_step + g * world + r]);
      const StepResult got = engine.train_step(mine, lr, max_grad_norm);
      EXPECT_EQ(got.ce_sum, want[s].ce_sum) << "step " << s;
      EXPECT_EQ(got.aux_loss_sum, want[s].aux_loss_sum) << "step " << s;
      EXPECT_EQ(got.grad_norm, want[s].grad_norm) << "step " << s;
      EXPECT_EQ(got.clip_coef, want[s].clip_coef) << "step " << s;
      EXPECT_EQ(got.num_supervised, want[s].num_supervised);
      my_clipped = my_clipped || got.clip_coef < 1.0f;
      const std::vector<float>& grad = engine.step_gradient();
      const std::vector<float>& master = engine.state().master();
      ASSERT_EQ(grad.size(), want_grad[s][r].size());
      my_unequal += count_unequal(grad.data(), want_grad[s][r].data(), static_cast<int64_t>(grad.size()));
      my_unequal += count_unequal(master.data(), want_master[s][r].data(), static_cast<int64_t>(master.size()));
      my_compared += static_cast<int64_t>(grad.size() + master.size());
      // Against the plain one-rank step, piece by piece gathered into flat vectors.
      std::vector<float> g_mine, g_plain, m_mine, m_plain;
      for (const ParamEntry& piece : layout.state().entries()) {
        const int64_t at = full.entry(full.find(piece.name)).offset + piece.tensor_begin;
        g_mine.insert(g_mine.end(), grad.begin() + piece.offset, grad.begin() + piece.offset + piece.numel);
        g_plain.insert(g_plain.end(), plain_grad[s].begin() + at, plain_grad[s].begin() + at + piece.numel);
        m_mine.insert(m_mine.end(), master.begin() + piece.offset, master.begin() + piece.offset + piece.numel);
        m_plain.insert(m_plain.end(), plain_master[s].begin() + at, plain_master[s].begin() + at + piece.numel);
      }
      // Step 0 only: later steps start from weights that differ by the earlier steps' rounding.
      if (s == 0) my_grad = l2_relative(g_mine.data(), g_plain.data(), static_cast<int64_t>(g_mine.size()));
      my_master = std::max(my_master, l2_relative(m_mine.data(), m_plain.data(), static_cast<int64_t>(m_mine.size())));
    }
    std::lock_guard<std::mutex> lock(mutex);
    unequal += my_unequal, compared += my_compared, buckets = layout.num_buckets();
    worst_grad = std::max(worst_grad, my_grad), worst_master = std::max(worst_master, my_master);
    clipped = clipped || my_clipped;
  });
  std::printf("  %s%s%s world %d EP %d GA %lld, %lld buckets: %lld gradient+master elements vs the emulation, %lld "
              "not bitwise equal; vs plain one rank: step-0 gradient %.2e, master %.2e (L2 relative)%s\n",
              preset.c_str(), images ? " (images)" : "", freeze_vit ? " frozen ViT" : "", world, ep,
              static_cast<long long>(accumulation), static_cast<long long>(buckets), static_cast<long long>(compared),
              static_cast<long long>(unequal), worst_grad, worst_master, clipped ? ", clipped" : "");
  EXPECT_EQ(unequal, 0);
  EXPECT_GT(compared, 0);
  EXPECT_GT(buckets, 1);
  EXPECT_LE(worst_grad, 1e-6);
  EXPECT_LE(worst_master, 1e-4);
}

TEST(CpuEngineParallel, ZeroTwoEqualsTheDataParallelEmulation) {
  expect_zero2_matches_emulation("tiny-vl", true, false, 2, 2, 1);
  expect_zero2_matches_emulation("tiny-vl", true, false, 2, 2, 2);
  expect_zero2_matches_emulation("tiny-vl", true, true, 2, 2, 2);
  expect_zero2_matches_emulation("tiny-vl", true, false, 4, 4, 1);
  expect_zero2_matches_emulation("tiny", false, false, 2, 1, 2);  // data parallel only, experts sharded as dense
  // Two expert-parallel groups of 2: each expert block has 2 replicas that all-reduce its gradient.
  expect_zero2_matches_emulation("tiny-vl", true, false, 4, 2, 1);
  expect_zero2_matches_emulation("tiny-vl", true, false, 4, 2, 2);
}

}  // namespace
}  // namespace deltamoe
