// GpuEngine as one rank of a parallel job (expert parallel + ZeRO-2 on the device) against the
// plain one-rank GpuEngine, on the golden-sized text model (tiny) and the tiny VLM (with images):
// N = 2 and 4 logical ranks on one GPU (DeviceLoopbackComm: rank-ordered reductions), expert
// parallel EP = N and EP 2 of 4 (two replicas of each expert block), small dense buckets so that
// tensors are cut across buckets and ranks. Rank r takes micro-batches g * N + r of the step the
// one rank takes whole.
// - Evaluation logits and losses bitwise (the exchange only moves rows).
// - Step 1: the step's CE and aux sums bitwise, token counts equal; every rank's reduced gradient
//   piece against the one rank's accumulated gradient: expert pieces rel. L2 <= 1e-6, dense
//   pieces <= 1e-5 (reasons at the bounds). These runs keep fp32 expert gradients
//   (--expert_grad_dtype f32), so that only the association of fp32 sums differs; one run keeps
//   them bf16 (the default), whose roundings fall at other points on N ranks than on one.
// - AdamW after 3 steps: every rank's master pieces moved as the one rank's (the difference of the
//   updates <= 1% of the update).
// - 20 steps: the loss curve within 0.5% of the one rank's at every step.
// - Optimizer state: per-rank files written by 2 ranks resume 2 ranks bit for bit (next step
//   equal) and load on 1 rank (masters bitwise); one rank's file loads on 2 ranks.
// - NcclComm with one rank through the same sharded path: 3 steps bitwise the plain engine's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "checkpoint/random_init.h"
#include "core/error.h"
#include "kernels/common/tensor_compare.h"
#include "model/config.h"
#include "model/vision/mrope_positions.h"
#include "optim/optimizer_state.h"
#include "parallel/comm_options.h"
#include "parallel/gpu/device_loopback_comm.h"
#include "parallel/gpu/nccl_comm.h"
#include "parallel/thread_comm.h"
#include "train/cpu_engine.h"
#include "train/gpu/engine_test_batches.h"
#include "train/gpu/gpu_engine.h"
#include "train/parallel_layout.h"
#include "train/train_checkpoint.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kTokenBudget = 256;
constexpr int kMicroBatches = 4;  // of the global step; rank r of N takes g * N + r
constexpr int kSteps = 20;
constexpr double kLr = 1e-3;
constexpr double kNoClip = 1e9;  // the norm never clips: the updates depend on the gradients alone
// Dense buckets of 4096 elements: tiny's dense tensors are cut across buckets and across ranks.
constexpr int64_t kBucketElements = 4096;
// An owner's expert weight gradient is one grouped product over the rows every rank sent for a
// micro-batch; the one rank forms a product per micro-batch and adds them. Same terms, other fp32
// association: relative L2 of order 1e-7.
constexpr double kExpertGradRelL2 = 1e-6;
// bf16 expert gradients: the one rank rounds after each of its 4 micro-batches' products, an owner
// of N = 4 ranks with 2 replicas after each of its 2 and once more in the replicas' bf16 sum; each
// rounding moves an element by at most 2^-9 of it. Measured ~3e-3 (2 ranks).
constexpr double kExpertGradRelL2Bf16 = 1e-2;
// Dense gradients: each micro-batch's, reduce-scattered in rank order as the backward finishes each
// phase and added to the step's sum, where the one rank's kernels add the micro-batches into one
// buffer in turn: fp32 reassociation only.
constexpr double kDenseGradRelL2 = 1e-5;
// After 3 AdamW steps: ||master_N - master_1|| <= this x ||master_1 - master_0||. The gradients
// differ by fp32 rounding, and a bf16 weight that rounds the other way once changes later steps'
// forward slightly; a wrong piece, scale or step count moves the update by O(1).
constexpr double kUpdateRel = 1e-2;
// The same with bf16 expert gradients, whose step-1 differences are ~1e3 x larger (measured 8.9e-3
// after 3 steps on 2 ranks).
constexpr double kUpdateRelBf16 = 3e-2;
// The 20-step loss curve, per step (the 1-rank GPU and CPU curves agree to 3e-4 in the demo).
constexpr double kLossCurveRel = 5e-3;

struct Model {
  std::string preset;
  ModelCheckpoint checkpoint;
  std::vector<MicroBatch> batches;  // the global step
};



const Model& model(const std::string& preset) {
  static std::map<std::string, Model> models;
  auto it = models.find(preset);
  if (it != models.end()) return it->second;
  Model m;
  m.preset = preset;
  m.checkpoint = random_init_checkpoint(model_config_preset(preset), 0, DType::bf16);
  const ModelConfig& config = m.checkpoint.config;
  if (config.has_vision) {
    // Images on micro-batches 0 and 2 (so with 4 ranks two run no vision tower), text on 1 and 3.
    m.batches.push_back(synthetic_image_batch(config, {{{1, 4, 4}}, {}, {{1, 8, 4}}}, 11));
    m.batches.push_back(synthetic_text_batch(config, {30, 7, 19}, 12));
    m.batches.push_back(synthetic_image_batch(config, {{{1, 4, 8}, {1, 4, 4}}}, 13));
    m.batches.push_back(synthetic_text_batch(config, {3, 40}, 14));
  } else {
    m.batches.push_back(synthetic_text_batch(config, {9, 14, 5}, 1));
    m.batches.push_back(synthetic_text_batch(config, {3, 20}, 2));
    m.batches.push_back(synthetic_text_batch(config, {21, 1, 8}, 3));
    m.batches.push_back(synthetic_text_batch(config, {12, 12, 30}, 4));
  }
  return models.emplace(preset, std::move(m)).first->second;
}

// expert_grads: --expert_grad_dtype (f32 unless a test says: see the header).
EngineOptions engine_options(DType expert_grads = DType::f32) {
  EngineOptions options;
  options.expert_grad_dtype = expert_grads;
  options.freeze = FreezeOptions{false, false, false};  // the vision tower trains too (its pieces are sharded)
  options.max_tokens = kTokenBudget;
  options.print_memory_plan = false;
  options.aux_coef = 0.01;  // the aux loss's gradient is part of the comparison
  return options;
}

ParallelOptions parallel_options(int ep) {
  ParallelOptions p;
  p.expert_parallel_size = ep;
  p.distributed_optimizer = true;
  p.bucket_elements = kBucketElements;
  return p;
}

CommOptions comm_options() {
  CommOptions options;
  options.timeout_seconds = 600;  // N engines share one GPU and are built one after another
  return options;
}

// A state's pieces (one rank's) with values of one kind.
struct Pieces {
  std::vector<ParamEntry> entries;
  std::vector<std::vector<float>> values;
};

Pieces read_masters(const TrainStateStore& state) {
  Pieces out;
  for (int i = 0; i < state.layout().num_tensors(); ++i) {
    const ParamEntry& e = state.layout().entry(i);
    out.entries.push_back(e);
    std::vector<float> v(static_cast<size_t>(e.numel));
    state.read_state(StateKind::master, i, 0, e.numel, v.data());
    out.values.push_back(std::move(v));
  }
  return out;
}

Pieces read_gradients(const DeviceTrainState& state) {
  Pieces out;
  for (int i = 0; i < state.layout().num_tensors(); ++i) {
    out.entries.push_back(state.layout().entry(i));
    out.values.push_back(state.read_piece_gradient(i));
  }
  return out;
}

// Whole tensors by name from the one rank's pieces (each tensor one piece there).
std::map<std::string, std::vector<float>> by_name(const Pieces& pieces) {
  std::map<std::string, std::vector<float>> out;
  for (size_t i = 0; i < pieces.entries.size(); ++i) out[pieces.entries[i].name] = pieces.values[i];
  return out;
}

std::vector<float> slice(const std::map<std::string, std::vector<float>>& whole, const ParamEntry& piece) {
  const std::vector<float>& all = whole.at(piece.name);
  return std::vector<float>(all.begin() + piece.tensor_begin, all.begin() + piece.tensor_begin + piece.numel);
}

int64_t mismatches(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return -1;
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

double loss_of(const StepResult& r) { return r.ce_sum / static_cast<double>(std::max<int64_t>(1, r.num_supervised)); }

struct Reference {
  std::vector<std::vector<float>> logits;  // per global micro-batch
  std::vector<MicroBatchLoss> eval;
  std::vector<StepResult> steps;
  std::map<std::string, std::vector<float>> master0, grad1, master3;
  size_t gradient_bytes = 0;  // every trained tensor's fp32 gradient
};

// The plain one-rank engine over the whole step, 20 steps.
const Reference& reference(const std::string& preset, DType expert_grads = DType::f32) {
  static std::map<std::pair<std::string, DType>, Reference> cache;
  auto it = cache.find({preset, expert_grads});
  if (it != cache.end()) return it->second;
  const Model& m = model(preset);
  Reference ref;
  GpuEngine engine(m.checkpoint, engine_options(expert_grads));
  for (const MicroBatch& batch : m.batches) {
    std::vector<float> logits;
    ref.eval.push_back(engine.evaluate(batch, &logits));
    ref.logits.push_back(std::move(logits));
  }
  ref.master0 = by_name(read_masters(engine.state()));
  ref.gradient_bytes = engine.state().params().bytes().gradients;
  for (int step = 0; step < kSteps; ++step) {
    ref.steps.push_back(engine.train_step(m.batches, kLr, kNoClip));
    if (step == 0) ref.grad1 = by_name(read_gradients(engine.state()));
    if (step == 2) ref.master3 = by_name(read_masters(engine.state()));
  }
  return cache.emplace(std::pair{preset, expert_grads}, std::move(ref)).first->second;
}

struct RankRecord {
  std::vector<std::vector<float>> logits;  // its micro-batches g * N + r
  std::vector<MicroBatchLoss> eval;
  std::vector<StepResult> steps;
  Pieces grad1, master3;
  size_t gradient_bytes = 0;  // its expert slices' and the shared dense-group region's
};

std::vector<MicroBatch> rank_batches(const Model& m, int rank, int ranks) {
  std::vector<MicroBatch> mine;
  for (int g = 0; g * ranks + rank < kMicroBatches; ++g) mine.push_back(m.batches[static_cast<size_t>(g * ranks + rank)]);
  return mine;
}

std::vector<RankRecord> run_ranks(const std::string& preset, int ranks, int ep, int steps,
                                  DType expert_grads = DType::f32) {
  setenv("DELTAMOE_ATTENTION", "ours", 1);  // bitwise: cuDNN's attention backward adds with atomics
  const Model& m = model(preset);
  std::vector<RankRecord> records(static_cast<size_t>(ranks));
  std::mutex mutex;
  run_device_loopback(
      ranks, 0,
      [&](Communicator& comm) {
        RankRecord record;
        GpuEngine engine(m.checkpoint, engine_options(expert_grads), comm, parallel_options(ep));
        record.gradient_bytes = engine.state().params().bytes().gradients;
        const std::vector<MicroBatch> mine = rank_batches(m, comm.rank(), ranks);
        for (const MicroBatch& batch : mine) {
          std::vector<float> logits;
          record.eval.push_back(engine.evaluate(batch, &logits));
          record.logits.push_back(std::move(logits));
        }
        for (int step = 0; step < steps; ++step) {
          record.steps.push_back(engine.train_step(mine, kLr, kNoClip));
          if (step == 0) record.grad1 = read_gradients(engine.state());
          if (step == 2) record.master3 = read_masters(engine.state());
        }
        std::lock_guard<std::mutex> lock(mutex);
        records[static_cast<size_t>(comm.rank())] = std::move(record);
      },
      comm_options());
  return records;
}

void check_against_one_rank(const std::string& preset, int ranks, int ep, DType expert_grads = DType::f32) {
  SCOPED_TRACE(preset + ", " + std::to_string(ranks) + " ranks, EP " + std::to_string(ep) + ", " +
               std::string(dtype_name(expert_grads)) + " expert gradients");
  setenv("DELTAMOE_ATTENTION", "ours", 1);
  const Reference& ref = reference(preset, expert_grads);
  const std::vector<RankRecord> got = run_ranks(preset, ranks, ep, kSteps, expert_grads);
  const bool bf16 = expert_grads == DType::bf16;
  // The dense gradients are reduce-scattered group by group during the backward: no rank holds
  // them whole (1-rank: every trained tensor's gradient).
  for (int r = 0; r < ranks; ++r) EXPECT_LT(got[r].gradient_bytes, ref.gradient_bytes) << "rank " << r;
  // Evaluation: bitwise, micro-batch g * N + r on rank r.
  for (int r = 0; r < ranks; ++r) {
    for (size_t g = 0; g < got[r].logits.size(); ++g) {
      const size_t global = g * static_cast<size_t>(ranks) + static_cast<size_t>(r);
      EXPECT_EQ(mismatches(got[r].logits[g], ref.logits[global]), 0) << "rank " << r << " micro-batch " << global
                                                                     << ": logits not bitwise";
      EXPECT_EQ(got[r].eval[g].ce_sum, ref.eval[global].ce_sum) << "rank " << r << " micro-batch " << global;
      EXPECT_EQ(got[r].eval[g].aux_loss, ref.eval[global].aux_loss) << "rank " << r << " micro-batch " << global;
    }
  }
  // Step 1: losses and counts.
  for (int r = 0; r < ranks; ++r) {
    const StepResult& a = got[r].steps[0];
    const StepResult& b = ref.steps[0];
    EXPECT_EQ(a.ce_sum, b.ce_sum) << "rank " << r;
    EXPECT_EQ(a.aux_loss_sum, b.aux_loss_sum) << "rank " << r;
    EXPECT_EQ(a.num_supervised, b.num_supervised);
    EXPECT_EQ(a.num_tokens, b.num_tokens);
    EXPECT_EQ(a.num_micro_batches, b.num_micro_batches);
    EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-5 * b.grad_norm) << "rank " << r;
  }
  // Step 1 gradients, every rank's pieces.
  double worst_expert = 0, worst_dense = 0;
  int64_t expert_pieces = 0, dense_pieces = 0, elements = 0;
  for (int r = 0; r < ranks; ++r) {
    const Pieces& pieces = got[r].grad1;
    for (size_t i = 0; i < pieces.entries.size(); ++i) {
      const ParamEntry& piece = pieces.entries[i];
      const std::vector<float> want = slice(ref.grad1, piece);
      const std::vector<float>& have = pieces.values[i];
      ASSERT_EQ(have.size(), want.size()) << piece.name;
      const CompareResult c = compare_values(have.data(), want.data(), static_cast<int64_t>(want.size()));
      const bool expert = ep > 1 && is_routed_expert_tensor(piece.name);
      (expert ? worst_expert : worst_dense) = std::max(expert ? worst_expert : worst_dense, c.rel_l2);
      ++(expert ? expert_pieces : dense_pieces);
      elements += piece.numel;
      EXPECT_LE(c.rel_l2, expert ? (bf16 ? kExpertGradRelL2Bf16 : kExpertGradRelL2) : kDenseGradRelL2)
          << "rank " << r << " piece " << piece.name << " [" << piece.tensor_begin << ", "
          << piece.tensor_begin + piece.numel << ")";
    }
  }
  // Every element of every tensor is held: dense pieces once over the ranks, expert blocks once per
  // replica.
  int64_t want_elements = 0;
  for (const auto& [name, values] : ref.grad1)
    want_elements += static_cast<int64_t>(values.size()) * (ep > 1 && is_routed_expert_tensor(name) ? ranks / ep : 1);
  EXPECT_EQ(elements, want_elements) << "the ranks' pieces do not cover the trained tensors exactly";
  // AdamW after 3 steps.
  double diff2 = 0, update2 = 0;
  for (int r = 0; r < ranks; ++r) {
    const Pieces& pieces = got[r].master3;
    for (size_t i = 0; i < pieces.entries.size(); ++i) {
      const ParamEntry& piece = pieces.entries[i];
      if (ep > 1 && is_routed_expert_tensor(piece.name) && r >= ep) continue;  // a replica: counted once
      const std::vector<float> want = slice(ref.master3, piece), start = slice(ref.master0, piece);
      for (size_t k = 0; k < want.size(); ++k) {
        diff2 += std::pow(static_cast<double>(pieces.values[i][k]) - want[k], 2);
        update2 += std::pow(static_cast<double>(want[k]) - start[k], 2);
      }
    }
  }
  const double update_rel = std::sqrt(diff2 / std::max(update2, 1e-300));
  EXPECT_GT(update2, 0.0) << "the one rank's masters did not move";
  EXPECT_LE(update_rel, bf16 ? kUpdateRelBf16 : kUpdateRel) << "3 AdamW steps moved the masters differently";
  // The loss curve.
  double worst_loss = 0;
  for (int step = 0; step < kSteps; ++step) {
    for (int r = 0; r < ranks; ++r) {
      EXPECT_EQ(got[r].steps[step].ce_sum, got[0].steps[step].ce_sum) << "the ranks disagree on step " << step;
    }
    const double rel = std::fabs(loss_of(got[0].steps[step]) - loss_of(ref.steps[step])) / loss_of(ref.steps[step]);
    worst_loss = std::max(worst_loss, rel);
    EXPECT_LE(rel, kLossCurveRel) << "step " << step + 1 << ": loss " << loss_of(got[0].steps[step]) << " vs "
                                  << loss_of(ref.steps[step]);
  }
  EXPECT_LT(loss_of(ref.steps[kSteps - 1]), loss_of(ref.steps[0])) << "the reference did not learn";
  std::printf("%s, %d ranks, EP %d, %s expert gradients: logits/losses bitwise checked; step-1 gradients: %lld "
              "expert pieces worst rel_l2 %.3e, %lld dense pieces worst %.3e; masters after 3 steps: update "
              "difference %.3e; loss %.4f -> %.4f (1 rank %.4f -> %.4f), worst step difference %.3e\n",
              preset.c_str(), ranks, ep, std::string(dtype_name(expert_grads)).c_str(),
              static_cast<long long>(expert_pieces), worst_expert,
              static_cast<long long>(dense_pieces), worst_dense, update_rel, loss_of(got[0].steps[0]),
              loss_of(got[0].steps[kSteps - 1]), loss_of(ref.steps[0]), loss_of(ref.steps[kSteps - 1]), worst_loss);
}

TEST(GpuEngineParallel, TextTwoRanksMatchOneRank) { check_against_one_rank("tiny", 2, 2); }
TEST(GpuEngineParallel, TextFourRanksMatchOneRank) { check_against_one_rank("tiny", 4, 4); }
TEST(GpuEngineParallel, TextFourRanksTwoExpertReplicasMatchOneRank) { check_against_one_rank("tiny", 4, 2); }
// The default bf16 expert gradients, summed over two replicas in bf16.
TEST(GpuEngineParallel, Bf16ExpertGradientsFourRanksTwoReplicasMatchOneRank) {
  check_against_one_rank("tiny", 4, 2, DType::bf16);
}
TEST(GpuEngineParallel, TextTwoRanksDataParallelOnlyMatchOneRank) { check_against_one_rank("tiny", 2, 1); }
TEST(GpuEngineParallel, VlmTwoRanksMatchOneRank) { check_against_one_rank("tiny-vl", 2, 2); }
TEST(GpuEngineParallel, VlmFourRanksMatchOneRank) { check_against_one_rank("tiny-vl", 4, 4); }

std::string temp_dir(const std::string& tag) {
  const fs::path dir = fs::temp_directory_path() / ("deltamoe_gpu_parallel_" + tag + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

// Per-rank optimizer files as the trainer writes them: 2 ranks resume bit for bit; 1 rank reads
// them (masters bitwise, and its next step's loss bitwise that of the 2 ranks); one rank's file
// loads on 2 ranks (masters bitwise).
TEST(GpuEngineParallel, OptimizerFilesReshardBetweenOneAndTwoRanks) {
  setenv("DELTAMOE_ATTENTION", "ours", 1);
  const Model& m = model("tiny");
  const std::string dir = temp_dir("reshard");
  constexpr int kRanks = 2;
  std::vector<StepResult> step4(kRanks), resumed4(kRanks);
  std::vector<Pieces> masters3(kRanks), loaded(kRanks);
  std::mutex mutex;
  run_device_loopback(
      kRanks, 0,
      [&](Communicator& comm) {
        GpuEngine engine(m.checkpoint, engine_options(), comm, parallel_options(kRanks));
        const std::vector<MicroBatch> mine = rank_batches(m, comm.rank(), kRanks);
        for (int step = 0; step < 3; ++step) engine.train_step(mine, kLr, kNoClip);
        save_optimizer_state((fs::path(dir) / optimizer_rank_file(comm.rank(), kRanks)).string(), engine.state(),
                             OptimizerProgress{3, 0});
        Pieces masters = read_masters(engine.state());
        const StepResult next = engine.train_step(mine, kLr, kNoClip);
        std::lock_guard<std::mutex> lock(mutex);
        masters3[static_cast<size_t>(comm.rank())] = std::move(masters);
        step4[static_cast<size_t>(comm.rank())] = next;
      },
      comm_options());
  // 2 -> 2: the resumed step equals the uninterrupted one bit for bit.
  run_device_loopback(
      kRanks, 0,
      [&](Communicator& comm) {
        GpuEngine engine(m.checkpoint, engine_options(), comm, parallel_options(kRanks));
        // Every trained tensor, as the trainer passes: another rank's file holds tensors of which
        // this rank has no piece.
        const OptimizerProgress progress =
            load_checkpoint_optimizer(dir, &engine.state(), &engine.parallel_layout()->full());
        EXPECT_EQ(progress.schedule_step, 3);
        EXPECT_EQ(engine.state().adam_step(), 3);
        const StepResult next = engine.train_step(rank_batches(m, comm.rank(), kRanks), kLr, kNoClip);
        std::lock_guard<std::mutex> lock(mutex);
        resumed4[static_cast<size_t>(comm.rank())] = next;
      },
      comm_options());
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(resumed4[r].ce_sum, step4[r].ce_sum) << "rank " << r;
    EXPECT_EQ(resumed4[r].aux_loss_sum, step4[r].aux_loss_sum) << "rank " << r;
    EXPECT_EQ(resumed4[r].grad_norm, step4[r].grad_norm) << "rank " << r;
  }
  // 2 -> 1: the plain engine holds every piece's master bitwise; its next step's losses equal.
  {
    GpuEngine one(m.checkpoint, engine_options());
    load_checkpoint_optimizer(dir, &one.state());
    const std::map<std::string, std::vector<float>> whole = by_name(read_masters(one.state()));
    int64_t differing = 0, compared = 0;
    for (const Pieces& pieces : masters3) {
      for (size_t i = 0; i < pieces.entries.size(); ++i) {
        differing += mismatches(slice(whole, pieces.entries[i]), pieces.values[i]);
        compared += pieces.entries[i].numel;
      }
    }
    EXPECT_EQ(differing, 0) << "of " << compared << " master values read on one rank";
    const StepResult next = one.train_step(m.batches, kLr, kNoClip);
    EXPECT_EQ(next.ce_sum, step4[0].ce_sum) << "one rank's step 4 after loading the 2 ranks' files";
    EXPECT_EQ(next.aux_loss_sum, step4[0].aux_loss_sum);
  }
  // 1 -> 2: one rank's optimizer.safetensors read by 2 ranks.
  const std::string one_dir = temp_dir("reshard_one");
  std::map<std::string, std::vector<float>> one_masters;
  {
    GpuEngine one(m.checkpoint, engine_options());
    for (int step = 0; step < 3; ++step) one.train_step(m.batches, kLr, kNoClip);
    save_optimizer_state((fs::path(one_dir) / "optimizer.safetensors").string(), one.state(), OptimizerProgress{3, 0});
    one_masters = by_name(read_masters(one.state()));
  }
  run_device_loopback(
      kRanks, 0,
      [&](Communicator& comm) {
        GpuEngine engine(m.checkpoint, engine_options(), comm, parallel_options(kRanks));
        load_checkpoint_optimizer(one_dir, &engine.state(), &engine.parallel_layout()->full());
        Pieces masters = read_masters(engine.state());
        std::lock_guard<std::mutex> lock(mutex);
        loaded[static_cast<size_t>(comm.rank())] = std::move(masters);
      },
      comm_options());
  for (int r = 0; r < kRanks; ++r) {
    for (size_t i = 0; i < loaded[r].entries.size(); ++i) {
      EXPECT_EQ(mismatches(loaded[r].values[i], slice(one_masters, loaded[r].entries[i])), 0)
          << "rank " << r << " piece " << loaded[r].entries[i].name;
    }
  }
  fs::remove_all(dir);
  fs::remove_all(one_dir);
  std::printf("optimizer files: 2 -> 2 resume bitwise, 2 -> 1 masters and next losses bitwise, 1 -> 2 masters bitwise\n");
}

// NcclComm with one rank through the sharded path (per-phase reduce-scatter, norm all-reduce,
// sharded AdamW, all-gather) against the plain engine over 3 steps: step 1's losses bitwise (the
// forward is the same), its gradients within fp32 association (each micro-batch's dense gradient
// is reduced on its own and then added to the step's sum, where the plain engine's kernels add
// every micro-batch into one buffer), the masters after 3 steps within 1% of their update.
TEST(GpuEngineParallel, NcclOneRankIsThePlainEngine) {
  setenv("DELTAMOE_ATTENTION", "ours", 1);
  const Model& m = model("tiny");
  ASSERT_GT(m.batches.size(), 1u);  // several micro-batches: the per-micro-batch reduction is exercised
  std::vector<StepResult> plain_steps, nccl_steps;
  std::map<std::string, std::vector<float>> plain_masters0, plain_grad1, plain_masters;
  {
    GpuEngine plain(m.checkpoint, engine_options());
    plain_masters0 = by_name(read_masters(plain.state()));
    for (int step = 0; step < 3; ++step) {
      plain_steps.push_back(plain.train_step(m.batches, kLr, kNoClip));
      if (step == 0) plain_grad1 = by_name(read_gradients(plain.state()));
    }
    plain_masters = by_name(read_masters(plain.state()));
  }
  std::unique_ptr<Communicator> host = make_solo_comm();
  std::unique_ptr<Communicator> nccl = make_nccl_comm(*host, 0, comm_options());
  ASSERT_EQ(nccl->size(), 1);
  GpuEngine engine(m.checkpoint, engine_options(), *nccl, parallel_options(1));
  ASSERT_NE(engine.parallel_layout(), nullptr);
  EXPECT_GT(engine.parallel_layout()->num_buckets(), 1);
  EXPECT_GT(engine.parallel_layout()->num_groups(), 1);
  Pieces grad1;
  for (int step = 0; step < 3; ++step) {
    nccl_steps.push_back(engine.train_step(m.batches, kLr, kNoClip));
    if (step == 0) grad1 = read_gradients(engine.state());
  }
  EXPECT_EQ(nccl_steps[0].ce_sum, plain_steps[0].ce_sum);
  EXPECT_EQ(nccl_steps[0].aux_loss_sum, plain_steps[0].aux_loss_sum);
  EXPECT_NEAR(nccl_steps[0].grad_norm, plain_steps[0].grad_norm, 1e-5 * plain_steps[0].grad_norm);
  double worst = 0;
  for (size_t i = 0; i < grad1.entries.size(); ++i) {
    const std::vector<float> want = slice(plain_grad1, grad1.entries[i]);
    const CompareResult c = compare_values(grad1.values[i].data(), want.data(), static_cast<int64_t>(want.size()));
    worst = std::max(worst, c.rel_l2);
    EXPECT_LE(c.rel_l2, kDenseGradRelL2) << "piece " << grad1.entries[i].name;
  }
  const Pieces masters = read_masters(engine.state());
  double diff2 = 0, update2 = 0;
  for (size_t i = 0; i < masters.entries.size(); ++i) {
    const std::vector<float> want = slice(plain_masters, masters.entries[i]);
    const std::vector<float> start = slice(plain_masters0, masters.entries[i]);
    for (size_t k = 0; k < want.size(); ++k) {
      diff2 += std::pow(static_cast<double>(masters.values[i][k]) - want[k], 2);
      update2 += std::pow(static_cast<double>(want[k]) - start[k], 2);
    }
  }
  const double update_rel = std::sqrt(diff2 / std::max(update2, 1e-300));
  EXPECT_GT(update2, 0.0);
  EXPECT_LE(update_rel, kUpdateRel);
  for (int step = 1; step < 3; ++step) {
    const double rel = std::fabs(loss_of(nccl_steps[step]) - loss_of(plain_steps[step])) / loss_of(plain_steps[step]);
    EXPECT_LE(rel, 5e-3) << "step " << step + 1;
  }
  std::printf("NcclComm 1 rank (%s): step 1 losses bitwise, gradient pieces rel L2 <= %.2e, masters after 3 steps "
              "%.2e of their update from the plain engine's; grad norm %.9g vs %.9g\n",
              nccl_runtime_version().c_str(), worst, update_rel, nccl_steps[2].grad_norm, plain_steps[2].grad_norm);
}

// The language model frozen and the vision tower trained, EP 2 over 2 ranks: rank 0's
// micro-batches carry images, rank 1's none. The text backward holds the expert exchange's
// collectives, so rank 1 must run it too (input gradients only) or rank 0 waits for it until the
// deadline. The ranks keep in step and the losses follow the one-rank engine's.
TEST(GpuEngineParallel, FrozenLanguageModelWithTrainedVisionKeepsTheRanksInStep) {
  setenv("DELTAMOE_ATTENTION", "ours", 1);
  const Model& m = model("tiny-vl");
  EngineOptions options = engine_options();
  options.freeze = FreezeOptions{false, false, true};
  std::vector<StepResult> plain;
  {
    GpuEngine one(m.checkpoint, options);
    for (int step = 0; step < 2; ++step) plain.push_back(one.train_step(m.batches, kLr, kNoClip));
  }
  CommOptions comm = comm_options();
  comm.timeout_seconds = 60;  // a rank left waiting fails the test within a minute, not at 600 s
  std::vector<std::vector<StepResult>> got(2);
  std::mutex mutex;
  run_device_loopback(
      2, 0,
      [&](Communicator& c) {
        GpuEngine engine(m.checkpoint, options, c, parallel_options(2));
        const std::vector<MicroBatch> mine = rank_batches(m, c.rank(), 2);
        EXPECT_EQ(mine.front().image_grid_thw.empty(), c.rank() == 1) << "rank 0 takes the image micro-batches";
        std::vector<StepResult> steps;
        for (int step = 0; step < 2; ++step) steps.push_back(engine.train_step(mine, kLr, kNoClip));
        std::lock_guard<std::mutex> lock(mutex);
        got[static_cast<size_t>(c.rank())] = std::move(steps);
      },
      comm);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(got[static_cast<size_t>(r)].size(), 2u) << "rank " << r;
    EXPECT_EQ(got[static_cast<size_t>(r)][0].ce_sum, plain[0].ce_sum) << "rank " << r;
    const double rel = std::fabs(loss_of(got[static_cast<size_t>(r)][1]) - loss_of(plain[1])) / loss_of(plain[1]);
    EXPECT_LE(rel, kLossCurveRel) << "rank " << r;
  }
}

// LoRA trains on one rank: the parallel engine refuses it with a message.
TEST(GpuEngineParallel, RefusesLoraOnSeveralRanks) {
  const Model& m = model("tiny");
  std::unique_ptr<Communicator> host = make_solo_comm();
  std::unique_ptr<Communicator> nccl = make_nccl_comm(*host, 0, comm_options());
  EngineOptions options = engine_options();
  auto lora = std::make_shared<LoraAdapters>();
  options.lora = lora;
  try {
    GpuEngine engine(m.checkpoint, options, *nccl, parallel_options(1));
    FAIL() << "LoRA on the parallel GPU engine was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("lora"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace deltamoe
