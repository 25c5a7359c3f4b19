// GpuEngine against CpuEngine (the fp32 reference) on the tiny-vl model: one packed micro-batch's
// losses and gradients (text and images, under each freezing choice), evaluation; the optimizer
// step on the device against the CPU AdamW on the gradient it formed (bit for bit), and its norm
// against that of the gradient (one and two micro-batches); determinism and an
// exact resume through the optimizer-state file; steps of new packings that take nothing; the memory
// plan against the CPU planner; and the batches and runs the engine must refuse.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <filesystem>
#include <map>
#include <unistd.h>

#include "checkpoint/random_init.h"
#include "checkpoint/stored_tensor.h"
#include "core/cuda_check.h"
#include "core/device_alloc.h"
#include "core/error.h"
#include "kernels/common/tensor_compare.h"
#include "kernels/cudnn_sdpa/gpu/cudnn_sdpa.h"
#include "kernels/grouped_gemm/grouped_gemm_cuda.h"
#include "model/config.h"
#include "model/vision/mrope_positions.h"
#include "optim/grad_clip.h"
#include "optim/optimizer_state.h"
#include "train/batch_plan.h"
#include "train/cpu_engine.h"
#include "train/gpu/engine_test_batches.h"
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
// No per-tensor bound exceeds this, whatever the sensitivity: a sign-flipped or zeroed tensor
// (rel_l2 >= 1) always fails.
constexpr double kTensorCap = 0.3;
constexpr float kWeightPerturbation = 1.0f / 512.0f;
constexpr double kSensitivityFactor = 4.0;  // as gpu_text_model_gpu_test (its measured worst ratio)
constexpr int64_t kTokenBudget = 256;

struct Fixture {
  ModelCheckpoint checkpoint = random_init_checkpoint(model_config_preset("tiny-vl"), 0, DType::bf16);
};

EngineOptions engine_options(const FreezeOptions& freeze, int64_t max_tokens = kTokenBudget) {
  EngineOptions options;
  options.freeze = freeze;
  options.max_tokens = max_tokens;
  options.print_memory_plan = false;
  return options;
}

// The GPU engine's gradients of the trained tensors laid out as `layout` (the CPU engine's).
std::vector<float> gpu_gradients(const GpuEngine& gpu, const ParamLayout& layout) {
  std::vector<float> flat(static_cast<size_t>(layout.total_numel()), 0.0f);
  for (const ParamEntry& e : layout.entries()) {
    const std::vector<float> values = gpu.read_gradient(e.name);
    EXPECT_EQ(static_cast<int64_t>(values.size()), e.numel) << e.name;
    std::copy(values.begin(), values.end(), flat.begin() + e.offset);
  }
  return flat;
}

Fixture& fixture() {
  static Fixture f;
  return f;
}

MicroBatch packed_text_batch(const std::vector<int32_t>& lengths, uint32_t seed) {
  return synthetic_text_batch(fixture().checkpoint.config, lengths, seed);
}

MicroBatch packed_image_batch(const std::vector<std::vector<GridThw>>& grids, uint32_t seed) {
  return synthetic_image_batch(fixture().checkpoint.config, grids, seed);
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
// supervised count, aux loss, the gradient of ce_token_weight * CE_sum + aux_weight * aux (whole,
// per tensor and the vision tensors alone), and evaluation.
void compare_engines(const MicroBatch& batch, const FreezeOptions& freeze) {
  Fixture& f = fixture();
  const int64_t supervised = shifted_supervised(batch);
  ASSERT_GT(supervised, 0);
  const double ce_token_weight = 1.0 / static_cast<double>(supervised + 17);  // as if a global batch held more
  const double aux_weight = 0.01;
  CpuEngine cpu(f.checkpoint, engine_options(freeze));
  const ParamLayout& layout = cpu.state().layout();
  std::printf("batch: %lld tokens, %zu samples, %zu images, %lld supervised after the shift; trainable: %d tensors"
              " (freeze_vit %d, freeze_aligner %d, freeze_llm %d)\n",
              static_cast<long long>(batch.num_tokens()), batch.cu_seqlens.size() - 1, batch.image_grid_thw.size(),
              static_cast<long long>(supervised), layout.num_tensors(), freeze.freeze_vit, freeze.freeze_aligner,
              freeze.freeze_llm);

  const size_t n = static_cast<size_t>(layout.total_numel());
  std::vector<float> cpu_free_grad(n, 0.0f), cpu_grad(n, 0.0f);
  const MicroBatchLoss cpu_loss = cpu.forward_backward(batch, ce_token_weight, aux_weight, cpu_free_grad.data());
  GpuEngine gpu(f.checkpoint, engine_options(freeze));
  EXPECT_EQ(gpu.device_name().rfind("cuda:", 0), 0u) << gpu.device_name();
  EXPECT_EQ(gpu.state().layout().num_tensors(), layout.num_tensors()) << "the same tensors are trained";
  gpu.zero_gradients();
  const MicroBatchLoss gpu_loss = gpu.forward_backward(
      gpu.device_batch(batch), ce_token_weight * static_cast<double>(supervised), aux_weight);
  const std::vector<float> gpu_grad = gpu_gradients(gpu, layout);
  const std::vector<std::vector<int32_t>> gpu_routing = gpu.last_routing();
  // The CPU engine again, following the GPU's expert choices. How far that moves the CPU's own
  // gradient says whether the GPU routed any token differently (0: identical routing).
  cpu.set_forced_routing(gpu_routing);
  cpu.forward_backward(batch, ce_token_weight, aux_weight, cpu_grad.data());
  const double pinning_move =
      compare_values(cpu_grad.data(), cpu_free_grad.data(), static_cast<int64_t>(n)).rel_l2;
  const double unpinned = compare_values(gpu_grad.data(), cpu_free_grad.data(), static_cast<int64_t>(n)).rel_l2;
  std::printf("pinning the CPU to the GPU's routing moves its gradient by %.3e%s; GPU vs the free CPU: rel_l2 "
              "%.3e (printed, not asserted)\n",
              pinning_move, pinning_move == 0 ? " (the same routing)" : " (some tokens routed differently)", unpinned);
  // Conditioning: how far one bf16 rounding of every weight moves the CPU's gradient, routing
  // pinned to the GPU's as in the comparison.
  double sensitivity = 0, vision_sensitivity = 0;
  std::vector<double> tensor_sensitivity(static_cast<size_t>(layout.num_tensors()), 0.0);
  for (const uint32_t seed : {1u, 2u}) {
    const ModelCheckpoint perturbed = perturbed_checkpoint(f.checkpoint, seed);
    CpuEngine moved(perturbed, engine_options(freeze));
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
  const double grad_bound = std::min(kTensorCap, std::max(kGradRelL2, kSensitivityFactor * sensitivity));
  const double vision_bound = std::min(kTensorCap, std::max(kVisionGradRelL2, kSensitivityFactor * vision_sensitivity));
  std::printf("CPU sensitivity to one bf16 rounding of the weights (routing pinned): whole %.3e, vision %.3e -> "
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
  std::printf("gradient vs the pinned CPU (%zu values): max|diff| %.3e max|ref| %.3e rel_l2 %.3e%s\n", n,
              whole.max_abs_diff, whole.max_abs_ref, whole.rel_l2, whole.all_finite ? "" : " NOT FINITE");
  print_worst_tensors(layout, gpu_grad, cpu_grad, tensor_sensitivity);
  EXPECT_TRUE(whole.all_finite);
  EXPECT_GT(whole.max_abs_ref, 0.0);
  EXPECT_LE(whole.rel_l2, grad_bound);
  // Each tensor: a tensor at the wrong offset, missing or scaled wrongly is off by O(1). Where the
  // CPU's gradient is zero (a text batch's vision tower), the GPU's must be zero too.
  int tensors_checked = 0, zeros_checked = 0;
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const ParamEntry& e = layout.entry(i);
    const CompareResult r = compare_values(gpu_grad.data() + e.offset, cpu_grad.data() + e.offset, e.numel);
    if (r.max_abs_ref == 0) {
      EXPECT_EQ(r.max_abs_diff, 0.0) << e.name << ": the reference gradient is zero, the GPU's is not";
      ++zeros_checked;
      continue;
    }
    ++tensors_checked;
    const double bound =
        std::min(kTensorCap, std::max(kTensorFloor, kSensitivityFactor * tensor_sensitivity[static_cast<size_t>(i)]));
    EXPECT_LE(r.rel_l2, bound) << e.name << " (CPU sensitivity " << tensor_sensitivity[static_cast<size_t>(i)] << ")";
  }
  std::printf("%d tensors checked one by one (bound min(%.2f, max(%.2f, %.0f x sensitivity))), %d required zero\n",
              tensors_checked, kTensorCap, kTensorFloor, kSensitivityFactor, zeros_checked);
  // The vision tower's gradients are small next to the text model's, so they get their own check.
  const std::vector<float> gpu_vision = vision_values(layout, gpu_grad), cpu_vision = vision_values(layout, cpu_grad);
  if (!gpu_vision.empty() && !batch.image_grid_thw.empty()) {
    const CompareResult vision =
        compare_values(gpu_vision.data(), cpu_vision.data(), static_cast<int64_t>(gpu_vision.size()));
    std::printf("vision gradients (%zu values): max|diff| %.3e max|ref| %.3e rel_l2 %.3e\n", gpu_vision.size(),
                vision.max_abs_diff, vision.max_abs_ref, vision.rel_l2);
    EXPECT_TRUE(vision.all_finite);
    EXPECT_GT(vision.max_abs_ref, 0.0);
    EXPECT_LE(vision.rel_l2, vision_bound);
  }
  // Frozen tensors hold no gradient on the GPU at all (no master, no gradient, no weight products).
  for (const ParamSpec& spec : build_param_table(f.checkpoint.config)) {
    if (is_frozen(spec.name, freeze)) {
      EXPECT_THROW(gpu.read_gradient(spec.name), Error) << spec.name;
    }
  }

  // Evaluation: the same losses without a gradient (the CPU still pinned to the GPU's routing);
  // token accuracy counted on both sides (argmax near-ties may differ by a token or two).
  const MicroBatchLoss cpu_eval = cpu.evaluate(batch);
  const MicroBatchLoss gpu_eval = gpu.evaluate(batch);
  std::printf("eval    cpu ce_sum %.6f correct %lld | gpu ce_sum %.6f correct %lld\n", cpu_eval.ce_sum,
              static_cast<long long>(cpu_eval.num_correct), gpu_eval.ce_sum,
              static_cast<long long>(gpu_eval.num_correct));
  EXPECT_LE(rel_diff(gpu_eval.ce_sum, cpu_eval.ce_sum), kLossRel);
  // The same forward as the training pass's: equal bit for bit (the kernels are deterministic).
  EXPECT_EQ(gpu_eval.ce_sum, gpu_loss.ce_sum) << "evaluation and the training forward disagree";
  ASSERT_GE(gpu_eval.num_correct, 0);
  EXPECT_LE(std::llabs(gpu_eval.num_correct - cpu_eval.num_correct), 2 + supervised / 50);
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

// The fp32 master of every trained tensor, concatenated in the state's order (synchronises).
std::vector<float> read_master(const TrainStateStore& state) {
  std::vector<float> all;
  for (int i = 0; i < state.layout().num_tensors(); ++i) {
    std::vector<float> values(static_cast<size_t>(state.layout().entry(i).numel));
    state.read_state(StateKind::master, i, 0, static_cast<int64_t>(values.size()), values.data());
    all.insert(all.end(), values.begin(), values.end());
  }
  return all;
}

std::vector<uint8_t> read_moments(const TrainStateStore& state) {
  std::vector<uint8_t> all;
  const size_t element = dtype_size(state.adamw_config().moment_dtype);
  for (StateKind kind : {StateKind::exp_avg, StateKind::exp_avg_sq})
    for (int i = 0; i < state.layout().num_tensors(); ++i) {
      std::vector<uint8_t> bytes(static_cast<size_t>(state.layout().entry(i).numel) * element);
      state.read_state(kind, i, 0, state.layout().entry(i).numel, bytes.data());
      all.insert(all.end(), bytes.begin(), bytes.end());
    }
  return all;
}

// train_step on the device is the accumulated gradient of its micro-batches (within fp32 summation
// order: the step's first product into the routed experts' gradients writes them on another kernel
// than the one that adds), divided by the step's supervised tokens, and the CPU AdamW applied to the
// gradient the step formed: the same master weights, bit for bit (the AdamW kernel is the CPU's
// arithmetic).
TEST(GpuEngine, TrainStepIsTheAccumulatedGradientAndTheCpuAdamW) {
  Fixture& f = fixture();
  const std::vector<MicroBatch> batches = {packed_text_batch({40, 60}, 3), packed_image_batch({{{1, 4, 4}}, {}}, 4)};
  EngineOptions options = engine_options({false, false, false});
  options.aux_coef = 0.01;
  options.adamw.moment_dtype = DType::bf16;
  GpuEngine gpu(f.checkpoint, options);
  const ParamLayout& layout = gpu.state().layout();
  const auto read_gradients = [&] {
    std::vector<float> grad(static_cast<size_t>(layout.total_numel()), 0.0f);
    for (const ParamEntry& e : layout.entries()) {
      const std::vector<float> values = gpu.read_gradient(e.name);
      std::copy(values.begin(), values.end(), grad.begin() + e.offset);
    }
    return grad;
  };
  // The micro-batches' gradients added up one backward at a time.
  int64_t supervised = 0;
  for (const MicroBatch& b : batches) supervised += b.num_supervised;
  const MicroBatchWeights weights = micro_batch_weights(supervised, 2, options.aux_coef);
  gpu.zero_gradients();
  for (const MicroBatch& b : batches) {
    const DeviceBatch device = gpu.device_batch(b);
    gpu.forward_backward(device, weights.ce_token_weight * static_cast<double>(device.num_supervised()),
                         weights.aux_weight);
  }
  const std::vector<float> accumulated = read_gradients();
  // The CPU optimizer, from the master before the step.
  HostTrainState cpu(layout, options.adamw);
  for (int i = 0; i < layout.num_tensors(); ++i)
    gpu.state().read_state(StateKind::master, i, 0, layout.entry(i).numel, cpu.master().data() + layout.entry(i).offset);
  // The device step (no clipping: the coefficient would depend on the norm's last bits), then the
  // gradient it formed (AdamW leaves it in place).
  const StepResult result = gpu.train_step(batches, 1e-3, 0.0);
  std::vector<float> grad = read_gradients();
  double diff2 = 0.0, ref2 = 0.0;
  for (size_t i = 0; i < grad.size(); ++i) {
    const double d = static_cast<double>(grad[i]) - static_cast<double>(accumulated[i]);
    diff2 += d * d;
    ref2 += static_cast<double>(accumulated[i]) * accumulated[i];
  }
  const double rel_l2 = std::sqrt(diff2 / ref2);
  std::printf("the step's gradient against the backwards added up: rel_l2 %.3g\n", rel_l2);
  EXPECT_LE(rel_l2, 1e-6) << "the step's gradient is not its micro-batches' sum";
  divide_gradient(grad.data(), grad.size(), weights.gradient_divisor);
  const double cpu_norm = std::sqrt(sum_of_squares_f64(grad.data(), static_cast<int64_t>(grad.size())));
  cpu.optimizer().step(1e-3, cpu.master().data(), grad.data());
  std::printf("norm: device %.17g, CPU over the same gradient %.17g; h2d %llu bytes, d2h %llu bytes\n",
              result.grad_norm, cpu_norm, static_cast<unsigned long long>(result.host_to_device_bytes),
              static_cast<unsigned long long>(result.device_to_host_bytes));
  EXPECT_NEAR(result.grad_norm, cpu_norm, 1e-12 * cpu_norm);
  EXPECT_FALSE(gpu.last_step_summed_expert_squares()) << "two micro-batches: the experts' gradients are read back";
  EXPECT_FALSE(result.skipped);
  EXPECT_EQ(result.num_micro_batches, 2);
  EXPECT_EQ(result.num_supervised, supervised);
  EXPECT_GT(result.host_to_device_bytes, 0u);
  EXPECT_EQ(result.device_to_host_bytes, 2 * 12u + 8u);
  const std::vector<float> device_master = read_master(gpu.state());
  std::vector<float> cpu_master;
  for (const ParamEntry& e : layout.entries())
    cpu_master.insert(cpu_master.end(), cpu.master().begin() + e.offset, cpu.master().begin() + e.offset + e.numel);
  int64_t mismatches = 0;
  for (size_t i = 0; i < cpu_master.size(); ++i)
    mismatches += std::memcmp(&cpu_master[i], &device_master[i], sizeof(float)) != 0;
  std::printf("master after one step: %lld of %zu elements differ from the CPU AdamW's\n",
              static_cast<long long>(mismatches), cpu_master.size());
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(gpu.state().adam_step(), 1);
}

// A step of one micro-batch, where the routed experts' products form their sums of squares as
// they write them and the norm reads only the other gradients: its norm is that of the gradient it
// leaves behind, within the epilogue sums' bound, step after step (TrainStepIs... checks two micro-batches).
TEST(GpuEngine, StepNormIsThatOfTheGradientItLeaves) {
  Fixture& f = fixture();
  EngineOptions options = engine_options({false, false, false});
  options.aux_coef = 0.01;
  GpuEngine gpu(f.checkpoint, options);
  const std::vector<std::vector<MicroBatch>> steps = {
      {packed_text_batch({40, 60}, 5)}, {packed_image_batch({{{1, 4, 4}}, {}}, 8)}, {packed_text_batch({7}, 9)}};
  for (const std::vector<MicroBatch>& batches : steps) {
    int64_t supervised = 0;
    for (const MicroBatch& b : batches) supervised += b.num_supervised;
    const MicroBatchWeights weights =
        micro_batch_weights(supervised, static_cast<int64_t>(batches.size()), options.aux_coef);
    const StepResult result = gpu.train_step(batches, 1e-3, 1.0);
    const ParamLayout& layout = gpu.state().layout();
    std::vector<float> grad(static_cast<size_t>(layout.total_numel()), 0.0f);
    for (const ParamEntry& e : layout.entries()) {
      const std::vector<float> values = gpu.read_gradient(e.name);
      std::copy(values.begin(), values.end(), grad.begin() + e.offset);
    }
    divide_gradient(grad.data(), grad.size(), weights.gradient_divisor);
    const double norm = std::sqrt(sum_of_squares_f64(grad.data(), static_cast<int64_t>(grad.size())));
    std::printf("%zu micro-batch(es): step norm %.17g, norm of the gradient it left %.17g\n", batches.size(),
                result.grad_norm, norm);
    EXPECT_TRUE(gpu.last_step_summed_expert_squares()) << "the experts' norm share was read back, not summed";
    EXPECT_GT(norm, 0.0);
    // The experts' share within kWrittenSquaresRelErrorBf16 (the bf16 gradients' squares summed in the
    // epilogue; f32 ones are closer), so the norm within half that.
    EXPECT_NEAR(result.grad_norm, norm, 0.5 * kWrittenSquaresRelErrorBf16 * norm) << batches.size() << " micro-batch(es)";
  }
}

// Two engines, the same steps: the same bits (deterministic kernels). A third engine saved after
// two steps and restored from the optimizer-state file continues to the same bits.
TEST(GpuEngine, StepsAreDeterministicAndResumeExactly) {
  // Bitwise equal steps need our attention kernel: cuDNN's backward adds with atomics
  // (cudnn_attention_choice.h).
  setenv("DELTAMOE_ATTENTION", "ours", 1);
  Fixture& f = fixture();
  const std::vector<std::vector<MicroBatch>> steps = {
      {packed_text_batch({100, 50}, 21), packed_image_batch({{{1, 4, 6}}, {{1, 2, 2}}}, 22)},
      {packed_image_batch({{{1, 2, 4}}, {}}, 23)},
      {packed_text_batch({200}, 24)},
      {packed_text_batch({30, 30, 30}, 25), packed_image_batch({{{1, 4, 4}}}, 26)}};
  EngineOptions options = engine_options({false, false, false});
  options.aux_coef = 0.01;
  auto run = [&](GpuEngine& engine, size_t first, size_t end) {
    std::vector<double> losses;
    for (size_t s = first; s < end; ++s) {
      const StepResult r = engine.train_step(steps[s], 1e-3 / static_cast<double>(s + 1), 1.0);
      losses.push_back(r.ce_sum / static_cast<double>(r.num_supervised));
    }
    return losses;
  };
  GpuEngine a(f.checkpoint, options), b(f.checkpoint, options);
  const std::vector<double> losses_a = run(a, 0, steps.size());
  const std::vector<double> losses_b = run(b, 0, steps.size());
  EXPECT_EQ(losses_a, losses_b);
  EXPECT_TRUE(read_master(a.state()) == read_master(b.state())) << "two runs of the same steps differ";
  EXPECT_TRUE(read_moments(a.state()) == read_moments(b.state()));

  const std::filesystem::path file =
      std::filesystem::temp_directory_path() / ("deltamoe_gpu_resume_" + std::to_string(::getpid()));
  GpuEngine first(f.checkpoint, options);
  run(first, 0, 2);
  save_optimizer_state(file.string(), first.state(), OptimizerProgress{2, 0});
  const ModelCheckpoint other = random_init_checkpoint(model_config_preset("tiny-vl"), 99, DType::bf16);
  GpuEngine resumed(other, options);  // other weights: everything must come from the file
  load_optimizer_state(file.string(), &resumed.state());
  std::filesystem::remove(file);
  EXPECT_EQ(resumed.state().adam_step(), 2);
  const std::vector<double> tail = run(resumed, 2, steps.size());
  std::printf("losses: %.6f %.6f %.6f %.6f; resumed after 2: %.6f %.6f\n", losses_a[0], losses_a[1], losses_a[2],
              losses_a[3], tail[0], tail[1]);
  EXPECT_EQ(tail[0], losses_a[2]);
  EXPECT_EQ(tail[1], losses_a[3]);
  EXPECT_TRUE(read_master(resumed.state()) == read_master(a.state())) << "the resumed run differs";
  EXPECT_TRUE(read_moments(resumed.state()) == read_moments(a.state()));
  EXPECT_GT(std::fabs(losses_a[3] - losses_a[0]), 0.0);
  unsetenv("DELTAMOE_ATTENTION");
}

// Steps after the first take nothing however the packing changes: no device or pinned allocation,
// no cuDNN plan, and the GPU's memory in use unchanged (cudaMemGetInfo after a synchronisation): a
// library that picks or loads code by the exact token count shows here (a classic cuBLAS handle
// did, 2 MiB at one packing of the 35B bench; `deltamoe bench --vary_lengths true` checks the same at
// full widths). Text and image micro-batches of random sample counts, lengths and grids, one or two
// a step. The suite name says it reads the whole device (run_gpu_tests.sh runs it alone).
TEST(GpuEngineExclusive, StepsOfNewPackingsTakeNothing) {
  Fixture& f = fixture();
  GpuEngine gpu(f.checkpoint, engine_options({false, false, false}));
  std::mt19937 rng(20261206);
  auto below = [&rng](int n) { return static_cast<int>(rng() % static_cast<uint32_t>(n)); };
  auto text_batch = [&](uint32_t seed) {
    const int samples = 1 + below(6);
    std::vector<int32_t> lengths;
    for (int i = 0; i < samples; ++i) lengths.push_back(8 + below(static_cast<int>(kTokenBudget) / samples - 8));
    return packed_text_batch(lengths, seed);
  };
  auto image_batch = [&](uint32_t seed) {
    std::vector<std::vector<GridThw>> grids(static_cast<size_t>(1 + below(3)));
    for (auto& sample : grids)
      if (below(4) != 0) sample.push_back(GridThw{1, 2 * (1 + below(3)), 2 * (1 + below(3))});
    return packed_image_batch(grids, seed);
  };
  auto free_bytes = [] {
    CUDA_CHECK(cudaDeviceSynchronize());
    size_t free = 0, total = 0;
    CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return static_cast<int64_t>(free);
  };
  gpu.train_step({text_batch(1), image_batch(2)}, 1e-4, 1.0);
  const AllocationCounts allocations = allocation_counts();
  const int64_t plans = CudnnSdpa::plans_built();
  int64_t before = free_bytes();
  const int64_t after_first = before;
  for (uint32_t step = 0; step < 24; ++step) {
    std::vector<MicroBatch> batches;
    const int micro_batches = 1 + below(2);
    for (int m = 0; m < micro_batches; ++m) {
      const uint32_t seed = 10 + 2 * step + static_cast<uint32_t>(m);
      batches.push_back(below(2) == 0 ? text_batch(seed) : image_batch(seed));
    }
    const StepResult r = gpu.train_step(batches, 1e-4, 1.0);
    ASSERT_FALSE(r.skipped) << "step " << step + 2;
    const int64_t now = free_bytes();
    if (now != before) {
      std::printf("step %u (%zu micro-batches, %lld tokens): GPU memory in use %+lld bytes\n", step + 2,
                  batches.size(), static_cast<long long>(r.num_tokens), static_cast<long long>(before - now));
    }
    before = now;
  }
  const AllocationCounts after = allocation_counts();
  EXPECT_EQ(after.device, allocations.device) << "device allocations after the first step";
  EXPECT_EQ(after.pinned, allocations.pinned) << "pinned allocations after the first step";
  EXPECT_EQ(CudnnSdpa::plans_built(), plans) << "cuDNN plans built after the first step";
  EXPECT_EQ(before, after_first) << "the GPU's memory in use moved after the first step";
}

// The engine's exact plan against the CPU planner: the state's bytes and the activation layouts
// are the same code; the workspaces are the planner's estimate.
TEST(GpuEngine, MemoryPlanMatchesTheCpuPlanner) {
  Fixture& f = fixture();
  for (const FreezeOptions& freeze : {FreezeOptions{false, false, false}, FreezeOptions{true, true, false}}) {
    EngineOptions options = engine_options(freeze);
    options.max_image_pixels = 16 * 32 * 32;
    GpuEngine gpu(f.checkpoint, options);
    const MemoryPlan& exact = gpu.memory_plan();
    // The engine keeps the experts' gate/up rows and the GDN forward when they fit (they do
    // here): plan the same.
    EXPECT_TRUE(exact.keep_expert_rows);
    EXPECT_TRUE(exact.keep_gdn_forward);
    options.recompute.keep_expert_rows = exact.keep_expert_rows;
    options.recompute.keep_gdn_forward = exact.keep_gdn_forward;
    const MemoryPlan cpu = plan_training_memory(f.checkpoint.config, options);
    std::printf("freeze_vit %d: engine plan\n%sCPU planner\n%s", freeze.freeze_vit, exact.describe().c_str(),
                cpu.describe().c_str());
    EXPECT_EQ(exact.state(), cpu.state());
    EXPECT_EQ(exact.text.activations, cpu.text.activations);
    EXPECT_EQ(exact.text.inputs, cpu.text.inputs);
    EXPECT_EQ(exact.vision.activations, cpu.vision.activations);
    EXPECT_EQ(exact.vision.inputs, cpu.vision.inputs);
    EXPECT_EQ(exact.max_image_tokens, cpu.max_image_tokens);
    const DeviceParamBytes held = gpu.state().params().bytes();
    EXPECT_EQ(held.weights, exact.weights);
    EXPECT_EQ(held.master + held.gradients, exact.master + exact.gradients);
    EXPECT_EQ(gpu.state().moment_bytes(), exact.moments);
    EXPECT_EQ(held.frozen_f32, exact.frozen_f32);
  }
}

// What the engine refuses, with messages that say what to do.
TEST(GpuEngine, RefusesBatchesOutsideItsPlan) {
  Fixture& f = fixture();
  // 128 tokens and (128 / 8, at least 64) = 64 samples per micro-batch.
  GpuEngine gpu(f.checkpoint, engine_options({false, false, false}, 128));
  auto message_of = [&](const MicroBatch& batch) -> std::string {
    try {
      gpu.train_step({batch}, 1e-4, 1.0);
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

// A run that does not fit is refused before anything is allocated, with the plan.
TEST(GpuEngine, RefusesARunThatDoesNotFit) {
  Fixture& f = fixture();
  EngineOptions options = engine_options({false, false, false});
  options.device_memory_bytes = size_t{64} << 20;  // a 64 MiB device
  try {
    GpuEngine gpu(f.checkpoint, options);
    ADD_FAILURE() << "a run needing more than 64 MiB was accepted";
  } catch (const Error& error) {
    const std::string message = error.what();
    std::printf("%s\n", message.c_str());
    EXPECT_NE(message.find("does not fit on cuda:"), std::string::npos) << message;
    EXPECT_NE(message.find("The plan:"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace deltamoe
