// GpuEngine against CpuEngine (the fp32 reference) on the tiny-vl model: one packed text micro-batch
// through the TrainEngine contract (losses, the flat gradient added to the caller's buffer,
// evaluation), the per-micro-batch accumulation, and the batches the engine must refuse.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "checkpoint/random_init.h"
#include "checkpoint/stored_tensor.h"
#include "core/error.h"
#include "kernels/common/tensor_compare.h"
#include "model/config.h"
#include "model/vision/mrope_positions.h"
#include "train/cpu_engine.h"
#include "train/gpu/gpu_engine.h"
#include "train/trainable_params.h"

namespace deltamoe {
namespace {

// Bounds (engine.md): losses within 1e-2 relative, the whole flat gradient rel_l2 <= 2e-2, unless the
// model's own conditioning says a bf16 rounding moves it further. The gradients are compared with
// the CPU engine PINNED to the GPU's routing (CpuEngine::set_forced_routing, GpuEngine::last_routing),
// and the sensitivity is measured pinned as well: the H200 run of 2026-12-02 showed the unpinned
// per-tensor check failing on layer-2 MoE tensors (rel_l2 0.11-0.27, their own sensitivity ~1e-2)
// while the flat gradient passed; the GPU's bf16 activations move router inputs by ~1e-2, far more
// than one bf16 rounding of the weights, so near-tie tokens pick other experts there. The unpinned
// comparison is printed (with the number of tokens routed differently), not asserted. The GPU rounds activations to
// bf16 where the CPU keeps fp32 (same bf16 weights). Measured on the CPU (tiny-vl, std 0.02): scaling
// every weight by (1 + u 2^-9), about one bf16 rounding, moves the flat gradient by 2e-3 .. 1.5e-2
// (T = 97 .. 256), almost all of it routed experts at 8-18% (a near-tie sends a token to another
// expert) and the embedding at ~1%. So each case reruns the CPU engine with two such perturbed
// checkpoints and allows max(floor, kSensitivityFactor x the larger move); a composition bug (a
// missing term, a wrong scale or buffer) moves the gradient by O(1), far beyond either.
constexpr double kLossRel = 1e-2;
constexpr double kGradRelL2 = 2e-2;
// The vision tensors alone: their gradient passes the whole text backward (bf16) and then the
// tower's (gpu_vision_model_gpu_test holds the tower alone to 2e-2), so roughly twice the roundings.
constexpr double kVisionGradRelL2 = 4e-2;
// One tensor at a time, loosely (small tensors such as norm weights carry few values, so their
// relative error is noisier than the whole's): at least 0.1, which a composition bug exceeds.
constexpr double kTensorFloor = 0.1;
constexpr float kWeightPerturbation = 1.0f / 512.0f;
constexpr double kSensitivityFactor = 4.0;  // as gpu_text_model_gpu_test (its measured worst ratio)
constexpr int64_t kTokenBudget = 256;

struct Fixture {
  ModelCheckpoint checkpoint = random_init_checkpoint(model_config_preset("tiny-vl"), 0, DType::bf16);
  TrainableParams trainable = build_trainable_params(checkpoint, FreezeOptions{false, false, false});  // all
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

// Samples of the given lengths packed into one micro-batch: random ordinary token ids (below the
// special-token block, so no image placeholders), labels = ids with ~30% masked as prompt, text
// positions (t = h = w = index in the sample).
MicroBatch packed_text_batch(const std::vector<int32_t>& lengths, uint32_t seed) {
  const ModelConfig& config = fixture().checkpoint.config;
  // The tiny vocabulary ends with its 33 special tokens (image placeholders among them): stay below.
  const int32_t ordinary = static_cast<int32_t>(config.text.vocab_size) - 64;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, ordinary - 1);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  MicroBatch batch;
  batch.cu_seqlens.push_back(0);
  std::vector<int64_t> position;
  for (size_t s = 0; s < lengths.size(); ++s) {
    for (int32_t i = 0; i < lengths[s]; ++i) {
      const int32_t id = token(rng);
      batch.input_ids.push_back(id);
      batch.labels.push_back(unit(rng) < 0.3f ? -100 : id);
      if (batch.labels.back() != -100) ++batch.num_supervised;
      position.push_back(i);
    }
    batch.cu_seqlens.push_back(static_cast<int32_t>(batch.input_ids.size()));
    batch.sample_indices.push_back(static_cast<int64_t>(s));
  }
  for (int row = 0; row < 3; ++row) batch.positions.insert(batch.positions.end(), position.begin(), position.end());
  return batch;
}

// Samples with images, as the data pipeline packs them: per sample a few prompt tokens, then for
// each image <|vision_start|>, t*h*w/4 <|image_pad|> tokens, <|vision_end|>; then the supervised
// answer. grids[s] lists sample s's images (none: a text-only sample); pixel values random;
// positions are the 3-D rope positions of the model's processor.
MicroBatch packed_image_batch(const std::vector<std::vector<GridThw>>& grids, uint32_t seed) {
  const ModelConfig& config = fixture().checkpoint.config;
  const int64_t merge = config.vision.spatial_merge_size;
  const int32_t ordinary = static_cast<int32_t>(config.text.vocab_size) - 64;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, ordinary - 1);
  std::normal_distribution<float> pixel(0.0f, 1.0f);
  MicroBatch batch;
  batch.cu_seqlens.push_back(0);
  std::vector<GridThw> all_grids;
  auto add = [&](int32_t id, bool supervised) {
    batch.input_ids.push_back(id);
    batch.labels.push_back(supervised ? id : -100);
    batch.num_supervised += supervised;
  };
  for (size_t s = 0; s < grids.size(); ++s) {
    for (int i = 0; i < 5; ++i) add(token(rng), false);
    for (const GridThw& grid : grids[s]) {
      add(static_cast<int32_t>(config.vision_start_token_id), false);
      const int64_t patches = grid[0] * grid[1] * grid[2];
      for (int64_t i = 0; i < patches / (merge * merge); ++i) add(static_cast<int32_t>(config.image_token_id), false);
      add(static_cast<int32_t>(config.vision_end_token_id), false);
      for (int64_t i = 0; i < patches * config.vision.patch_dim(); ++i) batch.pixel_values.push_back(pixel(rng));
      batch.image_grid_thw.push_back(grid);
      all_grids.push_back(grid);
      batch.num_image_tokens += patches / (merge * merge);
    }
    for (int i = 0; i < 23; ++i) add(token(rng), true);
    batch.cu_seqlens.push_back(static_cast<int32_t>(batch.input_ids.size()));
    batch.sample_indices.push_back(static_cast<int64_t>(s));
  }
  const std::vector<int64_t> ids(batch.input_ids.begin(), batch.input_ids.end());
  batch.positions = compute_mrope_positions(ids.data(), batch.num_tokens(), batch.cu_seqlens, all_grids, {}, merge,
                                            config.image_token_id, config.video_token_id);
  return batch;
}

int64_t shifted_supervised(const MicroBatch& batch) {
  const std::vector<int64_t> shifted = shift_packed_labels(batch);
  return std::count_if(shifted.begin(), shifted.end(), [](int64_t label) { return label != -100; });
}

// The checkpoint with every tensor scaled by (1 + u 2^-9), u uniform in [-1, 1] (fixed seed), in fp32.
ModelCheckpoint perturbed_checkpoint(const ModelCheckpoint& base, uint32_t seed) {
  ModelCheckpoint out = base;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (auto& [name, tensor] : out.params) {
    HostTensor values = tensor.to_host().to_f32();
    float* data = values.as<float>();
    for (int64_t i = 0; i < values.numel(); ++i) data[i] *= 1.0f + kWeightPerturbation * unit(rng);
    tensor = StoredTensor::from_host(values);
  }
  return out;
}

double rel_diff(double got, double ref) { return std::fabs(got - ref) / std::max(std::fabs(ref), 1e-12); }

// The vision tensors' values of a flat buffer, concatenated (empty when none is trainable).
std::vector<float> vision_values(const ParamLayout& layout, const std::vector<float>& flat) {
  std::vector<float> values;
  for (const ParamEntry& entry : layout.entries())
    if (entry.name.starts_with("model.visual."))
      values.insert(values.end(), flat.begin() + entry.offset, flat.begin() + entry.offset + entry.numel);
  return values;
}

double vision_rel_l2(const ParamLayout& layout, const std::vector<float>& got, const std::vector<float>& ref) {
  const std::vector<float> a = vision_values(layout, got), b = vision_values(layout, ref);
  return a.empty() ? 0.0 : compare_values(a.data(), b.data(), static_cast<int64_t>(a.size())).rel_l2;
}

// Prints the tensors that differ most (rel_l2) with the CPU's own sensitivity, to point at a
// component when a case fails.
void print_worst_tensors(const ParamLayout& layout, const std::vector<float>& got, const std::vector<float>& ref,
                         const std::vector<double>& sensitivity) {
  std::vector<std::pair<double, int>> worst;
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const ParamEntry& entry = layout.entry(i);
    const CompareResult r = compare_values(got.data() + entry.offset, ref.data() + entry.offset, entry.numel);
    if (r.max_abs_ref > 0 || r.max_abs_diff > 0) worst.emplace_back(r.rel_l2, i);
  }
  std::sort(worst.rbegin(), worst.rend());
  for (size_t k = 0; k < std::min<size_t>(6, worst.size()); ++k) {
    const int i = worst[k].second;
    std::printf("    worst tensor %zu: %-60s rel_l2 %.3e (CPU sensitivity %.3e)\n", k + 1, layout.entry(i).name.c_str(),
                worst[k].first, sensitivity[static_cast<size_t>(i)]);
  }
}

// One micro-batch through both engines with the trainable tensors of `freeze`: CE sum,
// supervised count, aux loss, the flat gradient of ce/S + aux_weight * aux (whole and the vision
// tensors alone), and evaluation.
void compare_engines(const MicroBatch& batch, const FreezeOptions& freeze) {
  Fixture& f = fixture();
  const TrainableParams trainable = build_trainable_params(f.checkpoint, freeze);
  const ParamLayout& layout = trainable.layout;
  const int64_t supervised = shifted_supervised(batch);
  ASSERT_GT(supervised, 0);
  const double ce_token_weight = 1.0 / static_cast<double>(supervised + 17);  // as if a global batch held more
  const double aux_weight = 0.01;
  std::printf("batch: %lld tokens, %zu samples, %zu images, %lld supervised after the shift; trainable: %d tensors"
              " (freeze_vit %d, freeze_aligner %d, freeze_llm %d)\n",
              static_cast<long long>(batch.num_tokens()), batch.cu_seqlens.size() - 1, batch.image_grid_thw.size(),
              static_cast<long long>(supervised), layout.num_tensors(), freeze.freeze_vit, freeze.freeze_aligner,
              freeze.freeze_llm);

  // Zeroed buffers (a constant running total would round small gradients away); that the engines
  // add to the buffer is AccumulatesMicroBatchesAndTakesNewWeights' check.
  const size_t n = static_cast<size_t>(layout.total_numel());
  std::vector<float> cpu_free_grad(n, 0.0f), cpu_grad(n, 0.0f), gpu_grad(n, 0.0f);
  CpuEngine cpu(f.checkpoint, layout);
  cpu.set_trainable_weights(trainable.master.data());
  const MicroBatchLoss cpu_loss = cpu.forward_backward(batch, ce_token_weight, aux_weight, cpu_free_grad.data());
  GpuEngine gpu(f.checkpoint, layout, EngineSizing{kTokenBudget, 0});
  EXPECT_EQ(gpu.device_name().rfind("cuda:", 0), 0u) << gpu.device_name();
  gpu.set_trainable_weights(trainable.master.data());
  const MicroBatchLoss gpu_loss = gpu.forward_backward(batch, ce_token_weight, aux_weight, gpu_grad.data());
  const std::vector<std::vector<int32_t>> gpu_routing = gpu.last_routing();
  // The CPU engine again, following the GPU's expert choices. How far that moves the CPU's own
  // gradient says whether the GPU routed any token differently (0: identical routing).
  cpu.set_forced_routing(gpu_routing);
  cpu.forward_backward(batch, ce_token_weight, aux_weight, cpu_grad.data());
  const double pinning_move =
      compare_values(cpu_grad.data(), cpu_free_grad.data(), static_cast<int64_t>(n)).rel_l2;
  const double unpinned = compare_values(gpu_grad.data(), cpu_free_grad.data(), static_cast<int64_t>(n)).rel_l2;
  std::printf("pinning the CPU to the GPU's routing moves its flat gradient by %.3e%s; GPU vs the free CPU: flat "
              "rel_l2 %.3e (printed, not asserted)\n",
              pinning_move, pinning_move == 0 ? " (the same routing)" : " (some tokens routed differently)", unpinned);
  // Conditioning: how far one bf16 rounding of every weight moves the CPU's gradient, routing
  // pinned to the GPU's as in the comparison.
  double sensitivity = 0, vision_sensitivity = 0;
  std::vector<double> tensor_sensitivity(static_cast<size_t>(layout.num_tensors()), 0.0);
  for (const uint32_t seed : {1u, 2u}) {
    const ModelCheckpoint perturbed = perturbed_checkpoint(f.checkpoint, seed);
    CpuEngine moved(perturbed, layout);
    moved.set_trainable_weights(build_trainable_params(perturbed, freeze).master.data());
    moved.set_forced_routing(gpu_routing);
    std::vector<float> moved_grad(n, 0.0f);
    moved.forward_backward(batch, ce_token_weight, aux_weight, moved_grad.data());
    sensitivity =
        std::max(sensitivity, compare_values(moved_grad.data(), cpu_grad.data(), static_cast<int64_t>(n)).rel_l2);
    vision_sensitivity = std::max(vision_sensitivity, vision_rel_l2(layout, moved_grad, cpu_grad));
    for (int i = 0; i < layout.num_tensors(); ++i) {
      const ParamEntry& e = layout.entry(i);
      tensor_sensitivity[static_cast<size_t>(i)] =
          std::max(tensor_sensitivity[static_cast<size_t>(i)],
                   compare_values(moved_grad.data() + e.offset, cpu_grad.data() + e.offset, e.numel).rel_l2);
    }
  }
  const double grad_bound = std::max(kGradRelL2, kSensitivityFactor * sensitivity);
  const double vision_bound = std::max(kVisionGradRelL2, kSensitivityFactor * vision_sensitivity);
  std::printf("CPU sensitivity to one bf16 rounding of the weights (routing pinned): flat %.3e, vision %.3e -> "
              "bounds %.3e, %.3e\n",
              sensitivity, vision_sensitivity, grad_bound, vision_bound);
  std::printf("unpinned worst tensors (GPU vs the free CPU, printed only):\n");
  print_worst_tensors(layout, gpu_grad, cpu_free_grad, tensor_sensitivity);

  std::printf("ce_sum  cpu %.6f gpu %.6f rel %.3e\n", cpu_loss.ce_sum, gpu_loss.ce_sum,
              rel_diff(gpu_loss.ce_sum, cpu_loss.ce_sum));
  std::printf("aux     cpu %.6f gpu %.6f rel %.3e\n", cpu_loss.aux_loss, gpu_loss.aux_loss,
              rel_diff(gpu_loss.aux_loss, cpu_loss.aux_loss));
  EXPECT_EQ(gpu_loss.num_supervised, cpu_loss.num_supervised);
  EXPECT_EQ(gpu_loss.num_tokens, batch.num_tokens());
  EXPECT_TRUE(std::isfinite(gpu_loss.ce_sum));
  EXPECT_LE(rel_diff(gpu_loss.ce_sum, cpu_loss.ce_sum), kLossRel);
  EXPECT_LE(rel_diff(gpu_loss.aux_loss, cpu_loss.aux_loss), kLossRel);

  const CompareResult whole = compare_values(gpu_grad.data(), cpu_grad.data(), static_cast<int64_t>(n));
  std::printf("flat gradient vs the pinned CPU (%zu values): max|diff| %.3e max|ref| %.3e rel_l2 %.3e%s\n", n,
              whole.max_abs_diff, whole.max_abs_ref, whole.rel_l2, whole.all_finite ? "" : " NOT FINITE");
  print_worst_tensors(layout, gpu_grad, cpu_grad, tensor_sensitivity);
  EXPECT_TRUE(whole.all_finite);
  EXPECT_GT(whole.max_abs_ref, 0.0);
  EXPECT_LE(whole.rel_l2, grad_bound);
  // Each tensor, loosely: a tensor at the wrong offset, missing or scaled wrongly is off by O(1).
  int tensors_checked = 0;
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const ParamEntry& e = layout.entry(i);
    const CompareResult r = compare_values(gpu_grad.data() + e.offset, cpu_grad.data() + e.offset, e.numel);
    if (r.max_abs_ref == 0) continue;  // no gradient on the CPU (a text batch's vision tower: checked below)
    ++tensors_checked;
    const double bound = std::max(kTensorFloor, kSensitivityFactor * tensor_sensitivity[static_cast<size_t>(i)]);
    EXPECT_LE(r.rel_l2, bound) << e.name << " (CPU sensitivity " << tensor_sensitivity[static_cast<size_t>(i)] << ")";
  }
  std::printf("%d tensors with a gradient checked one by one (bound max(%.2f, %.0f x sensitivity))\n",
              tensors_checked, kTensorFloor, kSensitivityFactor);
  // The vision tower's gradients are small next to the text model's, so they get their own check.
  const std::vector<float> gpu_vision = vision_values(layout, gpu_grad), cpu_vision = vision_values(layout, cpu_grad);
  if (!gpu_vision.empty()) {
    const CompareResult vision =
        compare_values(gpu_vision.data(), cpu_vision.data(), static_cast<int64_t>(gpu_vision.size()));
    std::printf("vision gradients (%zu values): max|diff| %.3e max|ref| %.3e rel_l2 %.3e\n", gpu_vision.size(),
                vision.max_abs_diff, vision.max_abs_ref, vision.rel_l2);
    EXPECT_TRUE(vision.all_finite);
    if (batch.image_grid_thw.empty()) {
      EXPECT_EQ(vision.max_abs_ref, 0.0);  // a text-only batch gives the tower nothing
      EXPECT_EQ(vision.max_abs_diff, 0.0);
    } else {
      EXPECT_GT(vision.max_abs_ref, 0.0);
      EXPECT_LE(vision.rel_l2, vision_bound);
    }
  }

  // Evaluation: the same losses without a gradient (the CPU still pinned to the GPU's routing);
  // token accuracy counted on both sides (argmax near-ties may differ by a token or two).
  const MicroBatchLoss cpu_eval = cpu.forward(batch);
  const MicroBatchLoss gpu_eval = gpu.forward(batch);
  std::printf("eval    cpu ce_sum %.6f correct %lld | gpu ce_sum %.6f correct %lld\n", cpu_eval.ce_sum,
              static_cast<long long>(cpu_eval.num_correct), gpu_eval.ce_sum,
              static_cast<long long>(gpu_eval.num_correct));
  EXPECT_LE(rel_diff(gpu_eval.ce_sum, cpu_eval.ce_sum), kLossRel);
  // The same forward as forward_backward's (fp32 atomics only in backwards): equal up to reordering.
  EXPECT_LE(rel_diff(gpu_eval.ce_sum, gpu_loss.ce_sum), 1e-5) << "forward and forward_backward disagree";
  ASSERT_GE(gpu_eval.num_correct, 0);
  EXPECT_LE(std::llabs(gpu_eval.num_correct - cpu_eval.num_correct), 2 + supervised / 50);
  EXPECT_GT(gpu.training_flops(batch), 0.0);
  EXPECT_GT(gpu.peak_memory_bytes(), 0u);
}

class GpuEngineTextTest : public ::testing::TestWithParam<std::vector<int32_t>> {};

TEST_P(GpuEngineTextTest, MatchesCpuEngineOnOneMicroBatch) {
  compare_engines(packed_text_batch(GetParam(), 11), FreezeOptions{false, false, false});
}

INSTANTIATE_TEST_SUITE_P(Batches, GpuEngineTextTest,
                         ::testing::Values(std::vector<int32_t>{97},                 // one sample, odd length
                                           std::vector<int32_t>{37, 1, 64, 90, 5},   // packed, a 1-token sample
                                           std::vector<int32_t>{256}));              // the whole budget

// Image batches (vision tower forward, its features in the <|image_pad|> rows, its backward from
// their gradient) under the freezing choices that decide which backward runs.
struct ImageCase {
  const char* name;
  FreezeOptions freeze;
};

class GpuEngineImageTest : public ::testing::TestWithParam<ImageCase> {};

TEST_P(GpuEngineImageTest, MatchesCpuEngineOnOneMicroBatch) {
  // Three samples: two images of 4x6 and 2x2 patches, one image of 2x4, and a text-only sample.
  const MicroBatch batch = packed_image_batch({{{1, 4, 6}, {1, 2, 2}}, {{1, 2, 4}}, {}}, 5);
  compare_engines(batch, GetParam().freeze);
}

INSTANTIATE_TEST_SUITE_P(
    Freezing, GpuEngineImageTest,
    ::testing::Values(ImageCase{"all_trained", {false, false, false}},
                      ImageCase{"swift_default_llm_only", {true, true, false}},
                      ImageCase{"frozen_llm_vit_trained", {false, true, true}},
                      ImageCase{"aligner_only", {true, false, true}}),
    [](const ::testing::TestParamInfo<ImageCase>& info) { return std::string(info.param.name); });

// Two micro-batches accumulate: the buffer after both is the sum of each alone; and the master
// weights handed over by set_trainable_weights are the ones the next forward uses.
TEST(GpuEngine, AccumulatesMicroBatchesAndTakesNewWeights) {
  Fixture& f = fixture();
  const ParamLayout& layout = f.trainable.layout;
  GpuEngine gpu(f.checkpoint, layout, EngineSizing{kTokenBudget, 0});
  gpu.set_trainable_weights(f.trainable.master.data());
  const MicroBatch a = packed_text_batch({40, 60}, 3), b = packed_text_batch({120}, 4);
  const size_t n = static_cast<size_t>(layout.total_numel());
  std::vector<float> grad_a(n, 0.0f), grad_b(n, 0.0f), grad_ab(n, 0.0f);
  gpu.forward_backward(a, 1e-2, 0.0, grad_a.data());
  gpu.forward_backward(b, 1e-2, 0.0, grad_b.data());
  gpu.forward_backward(a, 1e-2, 0.0, grad_ab.data());
  gpu.forward_backward(b, 1e-2, 0.0, grad_ab.data());
  std::vector<float> sum(n);
  for (size_t i = 0; i < n; ++i) sum[i] = grad_a[i] + grad_b[i];
  const CompareResult r = compare_values(grad_ab.data(), sum.data(), static_cast<int64_t>(n));
  std::printf("accumulated vs sum of parts: max|diff| %.3e rel_l2 %.3e\n", r.max_abs_diff, r.rel_l2);
  EXPECT_TRUE(r.all_finite);
  EXPECT_LE(r.rel_l2, 1e-5);  // the same products (fp32 atomics may reorder a few additions)

  // New weights: scaling lm_head changes the loss; restoring the master restores it.
  const double before = gpu.forward(a).ce_sum;
  std::vector<float> changed = f.trainable.master;
  const ParamEntry& head = layout.entry(layout.find("lm_head.weight"));
  for (int64_t i = 0; i < head.numel; ++i) changed[static_cast<size_t>(head.offset + i)] *= 20.0f;
  gpu.set_trainable_weights(changed.data());
  const double scaled = gpu.forward(a).ce_sum;
  gpu.set_trainable_weights(f.trainable.master.data());
  const double restored = gpu.forward(a).ce_sum;
  std::printf("ce_sum: %.6f, lm_head x20 %.6f, restored %.6f\n", before, scaled, restored);
  EXPECT_GT(rel_diff(scaled, before), 1e-2);
  EXPECT_LE(rel_diff(restored, before), 1e-5);  // the same weights again (a wrong upload is off by far more)
}

// What the engine refuses, with messages that say what to do.
TEST(GpuEngine, RefusesBatchesOutsideItsPlan) {
  Fixture& f = fixture();
  // 128 tokens and (128 / 8, at least 64) = 64 samples per micro-batch.
  GpuEngine gpu(f.checkpoint, f.trainable.layout, EngineSizing{128, 0});
  gpu.set_trainable_weights(f.trainable.master.data());
  std::vector<float> grad(static_cast<size_t>(f.trainable.layout.total_numel()), 0.0f);
  auto message_of = [&](const MicroBatch& batch) -> std::string {
    try {
      gpu.forward_backward(batch, 1.0, 0.0, grad.data());
    } catch (const Error& error) {
      return error.what();
    }
    return "";
  };
  const std::string too_long = message_of(packed_text_batch({129}, 1));
  std::printf("129 tokens: %s\n", too_long.c_str());
  EXPECT_NE(too_long.find("planned for at most 128"), std::string::npos) << too_long;
  const std::string too_many = message_of(packed_text_batch(std::vector<int32_t>(65, 1), 1));
  std::printf("65 samples: %s\n", too_many.c_str());
  EXPECT_NE(too_many.find("planned for at most 64"), std::string::npos) << too_many;
  EXPECT_NE(too_many.find("--micro_batch_size"), std::string::npos) << too_many;
  // Images whose merged tokens do not match the batch's <|image_pad|> tokens.
  MicroBatch with_image = packed_image_batch({{{1, 4, 4}}}, 1);
  with_image.image_grid_thw[0] = {1, 2, 8};
  with_image.pixel_values.resize(with_image.pixel_values.size() + 4 * 1536, 0.5f);
  const std::string image = message_of(with_image);
  std::printf("mismatched image: %s\n", image.c_str());
  EXPECT_NE(image.find("patches of pixel_values but its image_grid_thw describe"), std::string::npos) << image;
  with_image.image_grid_thw[0] = {1, 2, 10};  // 20 patches = 5 merged tokens, the batch has 4 pads
  const std::string pads = message_of(with_image);
  std::printf("image tokens: %s\n", pads.c_str());
  EXPECT_NE(pads.find("do not match"), std::string::npos) << pads;
}

TEST(GpuEngine, PlansSequencesFromTheBatchPlan) {
  EXPECT_EQ(planned_max_sequences(EngineSizing{1024, 0}), 128);
  EXPECT_EQ(planned_max_sequences(EngineSizing{100, 0}), 64);
  EXPECT_EQ(planned_max_sequences(EngineSizing{32, 0}), 32);
  EXPECT_EQ(planned_max_sequences(EngineSizing{8192, 4}), 4);
}

}  // namespace
}  // namespace deltamoe
