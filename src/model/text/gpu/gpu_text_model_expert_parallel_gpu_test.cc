// GpuTextModel with its routed experts split over N ranks (GpuExpertParallel over
// DeviceLoopbackComm, N logical ranks on one GPU) against the same ranks computing every expert
// themselves, each on its own micro-batch (different sequence counts and lengths, one rank
// routing few tokens). The exchange only moves rows: logits, losses, routing and every
// non-expert gradient of each rank must be bitwise equal. An owner's expert gradients sum the
// rows of all ranks in one weight-gradient product, where the reference sums each rank's product:
// equal within fp32 rounding (relative L2 <= 1e-5). Each rank binds its own experts only
// ([E / N, ...] slices of the stacks, local expert 0 first), as the engine does. The same with
// every layer recomputed in the backward (the forward's exchange plan reused).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "kernels/common/tensor_compare.h"
#include "model/config.h"
#include "model/gpu/device_params.h"
#include "model/param_table.h"
#include "model/text/gpu/gpu_text_model.h"
#include "model/text/text_params.h"
#include "model/text/text_weights.h"
#include "parallel/gpu/device_loopback_comm.h"

namespace deltamoe {
namespace {

struct RankBatch {
  std::vector<int64_t> ids, labels;
  std::vector<int32_t> cu_seqlens;
};

// Rank r's micro-batch: its own sequence lengths and tokens.
RankBatch batch_of(int rank, int64_t vocab) {
  static const std::vector<std::vector<int32_t>> lengths = {{9, 14, 5}, {3}, {21, 1, 8}, {12, 12}};
  RankBatch b;
  b.cu_seqlens.push_back(0);
  for (int32_t n : lengths[rank % 4]) b.cu_seqlens.push_back(b.cu_seqlens.back() + n);
  const int64_t T = b.cu_seqlens.back();
  for (int64_t t = 0; t < T; ++t) b.ids.push_back((t * 7919 + 13 + 1031 * rank) % vocab);
  b.labels.assign(T, -100);
  for (size_t s = 0; s + 1 < b.cu_seqlens.size(); ++s)
    for (int64_t t = b.cu_seqlens[s]; t + 1 < b.cu_seqlens[s + 1]; ++t) b.labels[t] = b.ids[t + 1];
  return b;
}

ParamMap rounded_params(const TextConfig& config) {
  ParamMap params = random_text_params(config, "model", 7, 0.05);
  for (auto& [name, tensor] : params) {
    if (name.find("A_log") != std::string::npos || name.find("dt_bias") != std::string::npos) continue;
    for (float& v : tensor.values) v = round_to_bf16(v);
  }
  return params;
}

bool is_expert_tensor(const std::string& name) { return name.find("mlp.experts.") != std::string::npos; }

struct RankRun {
  std::vector<float> logits;
  float loss = 0;
  double aux = 0;
  std::vector<std::vector<int32_t>> routing;
  std::map<std::string, std::vector<float>> grads;
};

// One forward + backward of rank `rank`'s micro-batch; experts split over `ep` when given.
RankRun run_rank(const TextConfig& config, const ParamMap& params, int rank, Communicator* ep,
                 int64_t recompute_layers) {
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  RankRun run;
  {
    const std::set<std::string> read_in_f32 = text_params_read_in_f32(config, "model");
    std::vector<DeviceParamSpec> specs;
    for (const ParamSpec& p : text_param_table(config, "model", true)) {
      DeviceParamSpec spec{p.name, p.shape.to_vector(), true, read_in_f32.count(p.name) != 0, p.init, 0.02};
      if (ep != nullptr && is_expert_tensor(p.name)) {
        // This rank's block of the stack: experts [rank * E / N, (rank + 1) * E / N).
        const int64_t local = config.num_experts / ep->size();
        spec.full_numel = p.shape.numel();
        spec.shape[0] = local;
        spec.full_first = ep->rank() * local * (spec.full_numel / config.num_experts);
      }
      specs.push_back(std::move(spec));
    }
    DeviceParams device_params(specs);
    for (const auto& [name, tensor] : params)
      device_params.upload(name, 0, static_cast<int64_t>(tensor.values.size()), tensor.values.data(), DType::f32);
    GpuModelOptions options;
    options.max_tokens = 48;
    options.max_seqs = 4;
    options.loss_chunk_rows = 16;
    options.aux_loss_weight = 0.01f;
    options.expert_parallel = ep;
    options.recompute_layers = recompute_layers;
    GpuTextModel model(config, bind_text_weights(config, "model", device_params.lookup()), options, stream);
    const RankBatch batch = batch_of(rank, config.vocab_size);
    model.set_batch(batch.ids, batch.labels, batch.cu_seqlens);
    model.forward_backward();
    run.loss = model.read_loss();
    run.aux = model.read_aux_loss();
    run.logits = model.compute_logits();
    for (int64_t l = 0; l < config.num_hidden_layers; ++l) run.routing.push_back(model.read_topk_idx(l));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    for (const ParamEntry& e : device_params.trained_layout().entries())
      run.grads[e.name] = device_params.read_gradient(e.name);
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
  return run;
}

void check_expert_parallel(int ranks, int64_t recompute_layers = 0) {
  // Bitwise comparisons need our attention kernel: cuDNN's backward adds with atomics
  // (cudnn_attention_choice.h).
  setenv("DELTAMOE_ATTENTION", "ours", 1);
  const TextConfig config = model_config_preset("tiny").text;
  ASSERT_EQ(config.num_experts % ranks, 0);
  const ParamMap params = rounded_params(config);
  std::vector<RankRun> want;
  for (int r = 0; r < ranks; ++r) want.push_back(run_rank(config, params, r, nullptr, recompute_layers));
  std::vector<RankRun> got(ranks);
  std::mutex mutex;
  run_device_loopback(ranks, 0, [&](Communicator& comm) {
    RankRun run = run_rank(config, params, comm.rank(), &comm, recompute_layers);
    std::lock_guard<std::mutex> lock(mutex);
    got[comm.rank()] = std::move(run);
  });
  const int64_t block = config.num_experts / ranks;
  int bitwise_dense = 0, dense = 0;
  double worst_expert = 0;
  for (int r = 0; r < ranks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(got[r].routing, want[r].routing);
    EXPECT_EQ(got[r].logits, want[r].logits) << "logits are not bitwise equal";
    EXPECT_EQ(got[r].loss, want[r].loss);
    EXPECT_EQ(got[r].aux, want[r].aux);
    EXPECT_FALSE(got[r].logits.empty());
    for (const auto& [name, grad] : want[r].grads) {
      const std::vector<float>& g = got[r].grads.at(name);
      if (!is_expert_tensor(name)) {
        ASSERT_EQ(g.size(), grad.size()) << name;
        ++dense;
        if (g == grad) {
          ++bitwise_dense;
        } else {
          ADD_FAILURE() << name << " differs from the rank computing every expert itself (rel_l2 "
                        << compare_values(g.data(), grad.data(), static_cast<int64_t>(g.size())).rel_l2 << ")";
        }
        continue;
      }
      // Expert stacks [E, ...]: rank r holds its block only, the sum over all ranks' rows.
      const int64_t per_expert = static_cast<int64_t>(grad.size()) / config.num_experts;
      ASSERT_EQ(static_cast<int64_t>(g.size()), block * per_expert) << name << " is not bound as rank " << r
                                                                      << "'s experts only";
      std::vector<float> sum(block * per_expert, 0.0f);
      for (int source = 0; source < ranks; ++source) {
        const std::vector<float>& part = want[source].grads.at(name);
        for (int64_t i = 0; i < block * per_expert; ++i) sum[i] += part[r * block * per_expert + i];
      }
      const CompareResult c = compare_values(g.data(), sum.data(), static_cast<int64_t>(sum.size()));
      worst_expert = std::max(worst_expert, c.rel_l2);
      EXPECT_LE(c.rel_l2, 1e-5) << name << " local experts";
      EXPECT_GT(c.max_abs_ref, 0.0) << name << ": the reference gradient is zero, the check shows nothing";
    }
  }
  std::printf("EP %d, %lld recomputed layers: logits, losses and routing bitwise on every rank; %d of %d non-expert gradients bitwise; "
              "worst local-expert gradient rel_l2 %.3e\n",
              ranks, static_cast<long long>(recompute_layers), bitwise_dense, dense, worst_expert);
}

TEST(GpuTextModelExpertParallel, TwoRanksMatchEachRankComputingAllExperts) { check_expert_parallel(2); }
TEST(GpuTextModelExpertParallel, FourRanksMatchEachRankComputingAllExperts) { check_expert_parallel(4); }
// Recomputed layers rerun their router in the backward and reuse the forward's exchange plan.
TEST(GpuTextModelExpertParallel, TwoRanksWithEveryLayerRecomputedMatch) {
  check_expert_parallel(2, model_config_preset("tiny").text.num_hidden_layers);
}

}  // namespace
}  // namespace deltamoe
