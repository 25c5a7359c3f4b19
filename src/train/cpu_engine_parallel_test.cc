// The CPU engine on several ranks (ThreadComm) against one rank (design §4.2): with expert
// parallelism the logits, CE and aux losses of every micro-batch and the experts' gradients are
// bitwise those of one rank running the same micro-batches in order (g, rank); with ZeRO-2 the dense
// gradients, the gradient norm and the AdamW master after 3 steps are bitwise those of a one-rank
// emulation of the data-parallel sums (one gradient per emulated rank and micro-batch, summed in
// rank order, sharded the same way), and within a small tolerance of the plain one-rank step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <mutex>

#include "checkpoint/random_init.h"
#include "core/rng.h"
#include "model/config.h"
#include "model/vision/mrope_positions.h"
#include "optim/grad_clip.h"
#include "parallel/thread_comm.h"
#include "train/batch_plan.h"
#include "train/cpu_engine.h"

namespace deltamoe {
namespace {

// Two packed samples; with images the first one carries a 4 x 4-patch image (4 merged tokens).
MicroBatch make_batch(const ModelConfig& config, uint64_t seed, bool image) {
  Rng rng(seed);
  MicroBatch batch;
  std::vector<int32_t> ids;
  std::vector<GridThw> grids;
  auto text = [&](int count) {
    for (int i = 0; i < count; ++i) ids.push_back(static_cast<int32_t>(rng.next_u64() % 4000));
  };
  text(5 + static_cast<int>(seed % 3));
  if (image) {
    ids.push_back(static_cast<int32_t>(config.vision_start_token_id));
    ids.insert(ids.end(), 4, static_cast<int32_t>(config.image_token_id));
    ids.push_back(static_cast<int32_t>(config.vision_end_token_id));
    grids.push_back({1, 4, 4});
    batch.image_grid_thw.push_back({1, 4, 4});
    batch.pixel_values.resize(static_cast<size_t>(16 * config.vision.patch_dim()));
    for (float& value : batch.pixel_values) value = static_cast<float>(rng.normal());
  }
  text(4);
  const int32_t first_end = static_cast<int32_t>(ids.size());
  text(6 + static_cast<int>(seed % 2));
  const int64_t T = static_cast<int64_t>(ids.size());
  batch.input_ids = ids;
  batch.cu_seqlens = {0, first_end, static_cast<int32_t>(T)};
  batch.labels.resize(ids.size());
  for (int64_t t = 0; t < T; ++t) {
    const bool prompt = t < 3 || (t >= first_end && t < first_end + 2);
    const bool media = ids[t] == config.image_token_id || ids[t] == config.vision_start_token_id ||
                       ids[t] == config.vision_end_token_id;
    batch.labels[t] = prompt || media ? -100 : ids[t];
  }
  for (int64_t t = 1; t < T; ++t) {
    const bool same_sample = (t < first_end) == (t - 1 < first_end);
    batch.num_supervised += same_sample && batch.labels[t] != -100;
  }
  std::vector<int64_t> ids64(ids.begin(), ids.end());
  batch.positions = compute_mrope_positions(ids64.data(), T, batch.cu_seqlens, grids, {},
                                            config.vision.spatial_merge_size, config.image_token_id,
                                            config.video_token_id);
  batch.sample_indices = {static_cast<int64_t>(2 * seed), static_cast<int64_t>(2 * seed + 1)};
  batch.num_image_tokens = image ? 4 : 0;
  return batch;
}

struct Setup {
  ModelCheckpoint checkpoint;
  EngineOptions options;
  std::vector<MicroBatch> batches;  // the global batches of all steps, micro-batch m of step s at s * M + m
};

Setup make_setup(const std::string& preset, bool images, bool freeze_vit, int64_t micro_batches_per_step, int steps) {
  Setup setup;
  const ModelConfig config = model_config_preset(preset);
  setup.checkpoint = random_init_checkpoint(config, 11, DType::f32);
  setup.options.freeze.freeze_vit = freeze_vit;
  setup.options.freeze.freeze_aligner = false;
  setup.options.aux_coef = 0.01;
  for (int64_t m = 0; m < micro_batches_per_step * steps; ++m) {
    setup.batches.push_back(make_batch(config, static_cast<uint64_t>(m + 1), images && m % 2 == 0));
  }
  return setup;
}

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

}  // namespace
}  // namespace deltamoe
