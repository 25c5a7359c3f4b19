// GpuEngine with LoRA (--tuner_type lora) on the tiny-vl model against CpuEngine, the fp32 reference,
// with the same adapters: ms-swift's default `--target_modules all-linear` plus the routed experts
// (every Linear of the text model and the vision tower), and adapters on the LLM only with the vision
// tower frozen, on a micro-batch with images; then determinism and a bit-exact resume of a LoRA run
// through the optimizer-state file (adapters' masters and moments compared bitwise with an
// uninterrupted run), also with LoRA dropout (the same masks as the CPU's, recomputed after a resume);
// and the CPU planner's count of the adapters' (and dropout's) scratch against the GPU models'.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <unistd.h>
#include <vector>

#include "checkpoint/random_init.h"
#include "checkpoint/stored_tensor.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/common/tensor_compare.h"
#include "model/config.h"
#include "model/lora/lora_adapters.h"
#include "model/text/gpu/gpu_text_model.h"
#include "model/vision/gpu/gpu_vision_model.h"
#include "model/vision/mrope_positions.h"
#include "optim/optimizer_state.h"
#include "train/batch_plan.h"
#include "train/cpu_engine.h"
#include "train/gpu/engine_test_batches.h"
#include "train/gpu/gpu_engine.h"
#include "train/memory_plan.h"

namespace deltamoe {
namespace {

// Bounds as gpu_engine_gpu_test's (its header derives them): the loss within 1e-2, the whole
// adapter gradient within max(2e-2, 4 x the CPU's own move under one bf16 rounding of every base
// weight), each tensor within min(0.3, max(0.1, 4 x its move)); the CPU pinned to the GPU's routing.
constexpr double kLossRel = 1e-2;
constexpr double kGradRelL2 = 2e-2;
constexpr double kTensorFloor = 0.1;
constexpr double kTensorCap = 0.3;
constexpr double kSensitivityFactor = 4.0;
constexpr float kWeightPerturbation = 1.0f / 512.0f;
constexpr int64_t kTokenBudget = 256;

const ModelCheckpoint& base_checkpoint() {
  static const ModelCheckpoint checkpoint = random_init_checkpoint(model_config_preset("tiny-vl"), 0, DType::bf16);
  return checkpoint;
}

// Adapters on `target_modules` (+ the routed experts when experts), A as PEFT initialises it and B
// random (PEFT's zero B would leave every A gradient zero), both rounded to bf16 so that the GPU's
// working copies hold the CPU's values.
std::shared_ptr<const LoraAdapters> adapters(const std::vector<std::string>& target_modules, bool experts,
                                             uint64_t seed, double dropout = 0) {
  LoraOptions options;
  options.rank = 4;
  options.alpha = 8;
  options.dropout = dropout;
  options.target_modules = target_modules;
  if (experts) options.target_parameters = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  LoraAdapters lora = init_lora_adapters(base_checkpoint().config, options, seed);
  std::mt19937 rng(static_cast<uint32_t>(seed) + 1);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (const LoraTarget& target : lora.targets) {
    HostTensor& a = lora.tensors.at(target.a_name());
    HostTensor& b = lora.tensors.at(target.b_name());
    for (int64_t i = 0; i < a.numel(); ++i) a.as<float>()[i] = round_to_bf16(a.as<float>()[i]);
    for (int64_t i = 0; i < b.numel(); ++i) b.as<float>()[i] = round_to_bf16(normal(rng));
  }
  return std::make_shared<const LoraAdapters>(std::move(lora));
}

EngineOptions lora_engine_options(std::shared_ptr<const LoraAdapters> lora) {
  EngineOptions options;
  options.lora = std::move(lora);
  options.max_tokens = kTokenBudget;
  options.print_memory_plan = false;
  options.aux_coef = 0.01;
  return options;
}

MicroBatch image_batch(const std::vector<std::vector<GridThw>>& grids, uint32_t seed) {
  return synthetic_image_batch(base_checkpoint().config, grids, seed);
}

// The base checkpoint with every tensor scaled by (1 + u 2^-9), about one bf16 rounding.
ModelCheckpoint perturbed_checkpoint(uint32_t seed) {
  ModelCheckpoint out = base_checkpoint();
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (auto& [name, tensor] : out.params) {
    HostTensor values = tensor.to_host().to_f32();
    for (int64_t i = 0; i < values.numel(); ++i) values.as<float>()[i] *= 1.0f + kWeightPerturbation * unit(rng);
    tensor = StoredTensor::from_host(values);
  }
  return out;
}

double rel_diff(double got, double ref) { return std::fabs(got - ref) / std::max(std::fabs(ref), 1e-12); }

// One image micro-batch through both engines with the same adapters: losses, every adapter's
// gradient, and (vision_adapted) that the vision tower's adapters get theirs.
void compare_lora_engines(std::shared_ptr<const LoraAdapters> lora, bool vision_adapted) {
  const MicroBatch batch = image_batch({{{1, 4, 6}, {1, 2, 2}}, {{1, 2, 4}}, {}}, 5);
  const EngineOptions options = lora_engine_options(lora);
  const std::vector<int64_t> shifted = shift_packed_labels(batch);
  const int64_t supervised = std::count_if(shifted.begin(), shifted.end(), [](int64_t l) { return l != -100; });
  const double ce_token_weight = 1.0 / static_cast<double>(supervised + 17), aux_weight = 0.01;

  GpuEngine gpu(base_checkpoint(), options);
  CpuEngine cpu(base_checkpoint(), options);
  const ParamLayout& layout = cpu.state().layout();
  ASSERT_EQ(gpu.state().layout().num_tensors(), layout.num_tensors()) << "the same tensors are trained";
  int vision_tensors = 0;
  for (const ParamEntry& e : layout.entries()) vision_tensors += e.name.starts_with("model.visual.");
  std::printf("LoRA on %zu targets (%d adapter tensors in the vision tower), %lld tokens, %zu images\n",
              lora->targets.size(), vision_tensors, static_cast<long long>(batch.num_tokens()),
              batch.image_grid_thw.size());
  EXPECT_EQ(vision_tensors > 0, vision_adapted);

  gpu.zero_gradients();
  const MicroBatchLoss gpu_loss =
      gpu.forward_backward(gpu.device_batch(batch), ce_token_weight * static_cast<double>(supervised), aux_weight);
  const size_t n = static_cast<size_t>(layout.total_numel());
  std::vector<float> gpu_grad(n, 0.0f), cpu_grad(n, 0.0f);
  for (const ParamEntry& e : layout.entries()) {
    const std::vector<float> values = gpu.read_gradient(e.name);
    ASSERT_EQ(static_cast<int64_t>(values.size()), e.numel) << e.name;
    std::copy(values.begin(), values.end(), gpu_grad.begin() + e.offset);
  }
  const std::vector<std::vector<int32_t>> routing = gpu.last_routing();
  cpu.set_forced_routing(routing);
  const MicroBatchLoss cpu_loss = cpu.forward_backward(batch, ce_token_weight, aux_weight, cpu_grad.data());

  double sensitivity = 0;
  std::vector<double> tensor_sensitivity(static_cast<size_t>(layout.num_tensors()), 0.0);
  for (const uint32_t seed : {1u, 2u}) {
    CpuEngine moved(perturbed_checkpoint(seed), options);
    moved.set_forced_routing(routing);
    std::vector<float> moved_grad(n, 0.0f);
    moved.forward_backward(batch, ce_token_weight, aux_weight, moved_grad.data());
    sensitivity = std::max(sensitivity, compare_values(moved_grad.data(), cpu_grad.data(), static_cast<int64_t>(n)).rel_l2);
    for (int i = 0; i < layout.num_tensors(); ++i) {
      const ParamEntry& e = layout.entry(i);
      tensor_sensitivity[static_cast<size_t>(i)] =
          std::max(tensor_sensitivity[static_cast<size_t>(i)],
                   compare_values(moved_grad.data() + e.offset, cpu_grad.data() + e.offset, e.numel).rel_l2);
    }
  }
  std::printf("ce_sum cpu %.6f gpu %.6f rel %.3e; aux cpu %.6f gpu %.6f\n", cpu_loss.ce_sum, gpu_loss.ce_sum,
              rel_diff(gpu_loss.ce_sum, cpu_loss.ce_sum), cpu_loss.aux_loss, gpu_loss.aux_loss);
  EXPECT_TRUE(std::isfinite(gpu_loss.ce_sum));
  EXPECT_LE(rel_diff(gpu_loss.ce_sum, cpu_loss.ce_sum), kLossRel);
  EXPECT_LE(rel_diff(gpu_loss.aux_loss, cpu_loss.aux_loss), kLossRel);

  const CompareResult whole = compare_values(gpu_grad.data(), cpu_grad.data(), static_cast<int64_t>(n));
  const double bound = std::min(kTensorCap, std::max(kGradRelL2, kSensitivityFactor * sensitivity));
  std::printf("adapter gradients (%zu values): rel_l2 %.3e (CPU sensitivity %.3e, bound %.3e)\n", n, whole.rel_l2,
              sensitivity, bound);
  EXPECT_TRUE(whole.all_finite);
  EXPECT_LE(whole.rel_l2, bound);
  double worst = 0;
  std::string worst_name;
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const ParamEntry& e = layout.entry(i);
    const CompareResult r = compare_values(gpu_grad.data() + e.offset, cpu_grad.data() + e.offset, e.numel);
    EXPECT_GT(r.max_abs_ref, 0.0) << e.name << ": the reference gradient is zero (the case tests nothing there)";
    const double tensor_bound =
        std::min(kTensorCap, std::max(kTensorFloor, kSensitivityFactor * tensor_sensitivity[static_cast<size_t>(i)]));
    EXPECT_LE(r.rel_l2, tensor_bound) << e.name << " (CPU sensitivity " << tensor_sensitivity[static_cast<size_t>(i)]
                                      << ")";
    if (!(r.rel_l2 <= worst)) {
      worst = r.rel_l2;
      worst_name = e.name;
    }
  }
  std::printf("%d adapter tensors checked one by one; worst rel_l2 %.3e (%s)\n", layout.num_tensors(), worst,
              worst_name.c_str());
  // The base is frozen: no tensor of the parameter table holds a gradient on the GPU.
  for (const ParamSpec& spec : build_param_table(base_checkpoint().config))
    EXPECT_THROW(gpu.read_gradient(spec.name), Error) << spec.name;
}

// ms-swift's default: all-linear (text and vision tower), plus the routed experts.
TEST(GpuEngineLora, VlmAllLinearMatchesCpuEngine) {
  EXPECT_EQ(gpu_lora_refusal(*adapters({"all-linear"}, true, 3)), "") << "all-linear runs on the GPU";
  compare_lora_engines(adapters({"all-linear"}, true, 3), true);
}

// --lora_dropout 0.2 on all-linear (PEFT refuses it on the experts): both engines draw the masks from
// the same counters (seed, optimizer step 0, micro-batch 0, adapter, row, column), so the GPU's
// gradients match the CPU's within the same bounds; and the masks matter: the CPU's gradients
// without dropout are far from those with it.
TEST(GpuEngineLora, VlmAllLinearDropoutMatchesCpuEngine) {
  const auto dropping = adapters({"all-linear"}, false, 3, 0.2);
  EXPECT_EQ(gpu_lora_refusal(*dropping), "") << "LoRA dropout runs on the GPU";
  compare_lora_engines(dropping, true);
  const MicroBatch batch = image_batch({{{1, 4, 6}, {1, 2, 2}}, {{1, 2, 4}}, {}}, 5);
  CpuEngine with(base_checkpoint(), lora_engine_options(dropping));
  CpuEngine without(base_checkpoint(), lora_engine_options(adapters({"all-linear"}, false, 3, 0.0)));
  const size_t n = static_cast<size_t>(with.state().layout().total_numel());
  std::vector<float> grad_with(n, 0.0f), grad_without(n, 0.0f);
  with.forward_backward(batch, 1e-2, 0.01, grad_with.data());
  without.forward_backward(batch, 1e-2, 0.01, grad_without.data());
  const double moved = compare_values(grad_without.data(), grad_with.data(), static_cast<int64_t>(n)).rel_l2;
  std::printf("dropout 0.2 moves the CPU's adapter gradients by rel_l2 %.3e\n", moved);
  EXPECT_GT(moved, 5 * kGradRelL2) << "the masks change too little for the comparison above to catch a missing mask";
}

// Adapters on the LLM only (attention, GDN, shared expert): the vision tower stays frozen and runs
// no backward, the image rows still reach the text model.
TEST(GpuEngineLora, LlmOnlyAdaptersWithFrozenVisionMatchCpuEngine) {
  compare_lora_engines(adapters({"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
                                 "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj", "shared_expert_gate"},
                                false, 4),
                       false);
}

// lm_head has no adapter path on the GPU (its product is the chunked loss kernel): refused by name.
TEST(GpuEngineLora, AnAdapterOnTheOutputLayerIsRefused) {
  const std::string why = gpu_lora_refusal(*adapters({"lm_head"}, false, 5));
  EXPECT_NE(why.find("lm_head"), std::string::npos) << why;
}

// The trained state (masters, both moments) of a store, or its gradients, as bytes per tensor, to
// compare bit for bit and say which tensors differ.
struct StateSnapshot {
  std::vector<std::string> labels;          // "<kind> of <tensor>"
  std::vector<std::vector<uint8_t>> bytes;  // per label
  std::vector<size_t> element_bytes;
};

StateSnapshot state_snapshot(const TrainStateStore& state) {
  StateSnapshot out;
  for (StateKind kind : {StateKind::master, StateKind::exp_avg, StateKind::exp_avg_sq}) {
    const char* kind_name =
        kind == StateKind::master ? "master" : kind == StateKind::exp_avg ? "exp_avg" : "exp_avg_sq";
    const size_t element = kind == StateKind::master ? sizeof(float) : dtype_size(state.adamw_config().moment_dtype);
    for (int i = 0; i < state.layout().num_tensors(); ++i) {
      const int64_t numel = state.layout().entry(i).numel;
      std::vector<uint8_t> bytes(static_cast<size_t>(numel) * element);
      state.read_state(kind, i, 0, numel, bytes.data());
      out.labels.push_back(str_cat(kind_name, " of ", state.layout().entry(i).name));
      out.bytes.push_back(std::move(bytes));
      out.element_bytes.push_back(element);
    }
  }
  return out;
}

// The gradients the engine's last step formed (they stay in place after the update).
StateSnapshot gradient_snapshot(GpuEngine& engine) {
  StateSnapshot out;
  for (const ParamEntry& e : engine.state().layout().entries()) {
    const std::vector<float> values = engine.read_gradient(e.name);
    std::vector<uint8_t> bytes(values.size() * sizeof(float));
    std::memcpy(bytes.data(), values.data(), bytes.size());
    out.labels.push_back("gradient of " + e.name);
    out.bytes.push_back(std::move(bytes));
    out.element_bytes.push_back(sizeof(float));
  }
  return out;
}

// "" when the snapshots are equal bit for bit, else the first differing tensors and how many of
// their elements differ.
std::string differences(const StateSnapshot& x, const StateSnapshot& y) {
  if (x.labels != y.labels) return "different layouts";
  std::string out;
  size_t listed = 0;
  for (size_t i = 0; i < x.labels.size(); ++i) {
    if (x.bytes[i] == y.bytes[i]) continue;
    size_t differing = 0;
    const size_t element = x.element_bytes[i];
    for (size_t e = 0; e + element <= x.bytes[i].size(); e += element)
      differing += std::memcmp(&x.bytes[i][e], &y.bytes[i][e], element) != 0;
    if (listed++ < 12)
      out += str_cat("  ", x.labels[i], ": ", differing, " of ", x.bytes[i].size() / element, " elements differ\n");
  }
  if (listed > 12) out += str_cat("  ... and ", listed - 12, " more tensors\n");
  return out;
}

// Two LoRA engines, the same steps: the same bits. A third saved after two steps and restored from
// the optimizer-state file into an engine whose adapters started elsewhere (another seed) continues
// to the same losses, adapter masters and moments, bit for bit. With LoRA dropout (all-linear only,
// as PEFT allows) the masks are recomputed from the run's seed and the restored step count.
void check_steps_deterministic_and_resume(double dropout) {
  setenv("DELTAMOE_ATTENTION", "ours", 1);  // cuDNN's attention backward adds dQ with atomics
  const std::vector<std::vector<MicroBatch>> steps = {
      {image_batch({{{1, 4, 6}}, {}}, 21), image_batch({{{1, 2, 2}}}, 22)},
      {image_batch({{{1, 2, 4}}, {}}, 23)},
      {image_batch({{}, {}}, 24)},
      {image_batch({{{1, 4, 4}}}, 25), image_batch({{{1, 2, 2}}, {{1, 2, 2}}}, 26)}};
  const bool experts = dropout == 0;
  EngineOptions options = lora_engine_options(adapters({"all-linear"}, experts, 7, dropout));
  options.adamw.moment_dtype = DType::bf16;
  // Each step's loss; its gradient norm and clipping factor printed (a clipped step spreads one
  // differing gradient over every update).
  auto run = [&](const char* name, GpuEngine& engine, size_t first, size_t end) {
    std::vector<double> losses;
    for (size_t s = first; s < end; ++s) {
      const StepResult r = engine.train_step(steps[s], 1e-3 / static_cast<double>(s + 1), 1.0);
      losses.push_back(r.ce_sum / static_cast<double>(r.num_supervised));
      std::printf("%s step %zu: loss %.9f grad norm %.9e clip %.9f\n", name, s, losses.back(), r.grad_norm,
                  static_cast<double>(r.clip_coef));
    }
    return losses;
  };
  GpuEngine a(base_checkpoint(), options), b(base_checkpoint(), options);
  std::vector<double> losses_a = run("a", a, 0, 3);
  const StateSnapshot a_after_step_2 = state_snapshot(a.state());
  const std::vector<double> a_last = run("a", a, 3, steps.size());
  losses_a.insert(losses_a.end(), a_last.begin(), a_last.end());
  const std::vector<double> losses_b = run("b", b, 0, steps.size());
  EXPECT_EQ(losses_a, losses_b);
  EXPECT_EQ(differences(state_snapshot(a.state()), state_snapshot(b.state())), "")
      << "two runs of the same steps differ";

  const std::filesystem::path file =
      std::filesystem::temp_directory_path() / ("deltamoe_gpu_lora_resume_" + std::to_string(::getpid()));
  GpuEngine first(base_checkpoint(), options);
  run("first", first, 0, 2);
  save_optimizer_state(file.string(), first.state(), OptimizerProgress{2, 0});
  EngineOptions other = options;
  // Other adapters: everything must come from the file (but the run's seed, which keys dropout's
  // masks and comes from --seed on a resume too).
  LoraAdapters moved = *adapters({"all-linear"}, experts, 99, dropout);
  moved.seed = options.lora->seed;
  other.lora = std::make_shared<const LoraAdapters>(std::move(moved));
  GpuEngine resumed(base_checkpoint(), other);
  load_optimizer_state(file.string(), &resumed.state());
  std::filesystem::remove(file);
  EXPECT_EQ(resumed.state().adam_step(), 2);
  // Step by step, so that a difference is pinned to the step (and, for the last, to its gradients).
  std::vector<double> tail = run("resumed", resumed, 2, 3);
  EXPECT_EQ(differences(state_snapshot(resumed.state()), a_after_step_2), "") << "the resumed run's first step differs";
  const std::vector<double> resumed_last = run("resumed", resumed, 3, steps.size());
  tail.insert(tail.end(), resumed_last.begin(), resumed_last.end());
  std::printf("LoRA losses: %.6f %.6f %.6f %.6f; resumed after 2: %.6f %.6f\n", losses_a[0], losses_a[1],
              losses_a[2], losses_a[3], tail[0], tail[1]);
  EXPECT_EQ(tail[0], losses_a[2]);
  EXPECT_EQ(tail[1], losses_a[3]);
  EXPECT_EQ(differences(gradient_snapshot(resumed), gradient_snapshot(a)), "") << "the last step's gradients differ";
  EXPECT_EQ(differences(state_snapshot(resumed.state()), state_snapshot(a.state())), "") << "the resumed run differs";
  EXPECT_GT(std::fabs(losses_a[3] - losses_a[0]), 0.0);
  unsetenv("DELTAMOE_ATTENTION");
}

// A step's bits are a function of the state and the step's micro-batches only, not of the shapes
// the engine ran before (an engine resumed from a file has run none, the one that saved it many):
// one engine runs other micro-batches first (their gradients are zeroed by the step), the other
// starts cold; the same step then forms the same gradients and the same state, bit for bit.
void check_step_independent_of_earlier_shapes(double dropout) {
  setenv("DELTAMOE_ATTENTION", "ours", 1);  // cuDNN's attention backward adds dQ with atomics
  EngineOptions options = lora_engine_options(adapters({"all-linear"}, dropout == 0, 7, dropout));
  options.adamw.moment_dtype = DType::bf16;
  const std::vector<MicroBatch> step = {image_batch({{{1, 4, 4}}}, 25), image_batch({{{1, 2, 2}}, {{1, 2, 2}}}, 26)};
  GpuEngine cold(base_checkpoint(), options), warmed(base_checkpoint(), options);
  for (const MicroBatch& other : {image_batch({{{1, 4, 6}}, {}}, 41), image_batch({{{1, 2, 6}}, {{1, 2, 2}}}, 42),
                                  image_batch({{}, {}, {}}, 43)})
    warmed.forward_backward(warmed.device_batch(other), 1.0, 0.01);
  const StepResult r_cold = cold.train_step(step, 1e-3, 1.0), r_warmed = warmed.train_step(step, 1e-3, 1.0);
  std::printf("dropout %.1f: grad norm cold %.9e warmed %.9e\n", dropout, r_cold.grad_norm, r_warmed.grad_norm);
  EXPECT_EQ(r_cold.ce_sum, r_warmed.ce_sum);
  EXPECT_EQ(differences(gradient_snapshot(warmed), gradient_snapshot(cold)), "")
      << "the gradients depend on earlier shapes";
  EXPECT_EQ(differences(state_snapshot(warmed.state()), state_snapshot(cold.state())), "")
      << "the update depends on earlier shapes";
  unsetenv("DELTAMOE_ATTENTION");
}

TEST(GpuEngineLora, AStepDoesNotDependOnEarlierShapes) {
  check_step_independent_of_earlier_shapes(0.0);
  check_step_independent_of_earlier_shapes(0.3);
}

TEST(GpuEngineLora, StepsAreDeterministicAndResumeExactly) { check_steps_deterministic_and_resume(0.0); }

TEST(GpuEngineLora, StepsWithDropoutAreDeterministicAndResumeExactly) { check_steps_deterministic_and_resume(0.3); }

// The CPU planner's LoRA scratch (memory_plan.h) is the GPU models' own, byte for byte: the
// workspace a rank-r text model plans minus one without adapters; the tower's adapter scratch.
TEST(GpuEngineLora, PlannerCountsTheAdaptersScratchExactly) {
  for (const char* preset : {"tiny-vl", "qwen3.5-35b-a3b"}) {
    const ModelConfig config = model_config_preset(preset);
    for (const int64_t rank : {int64_t{4}, int64_t{8}, int64_t{16}}) {
      GpuModelOptions model_options;
      model_options.max_tokens = 8192;
      model_options.max_seqs = 64;
      model_options.loss_chunk_rows = 1024;
      const size_t without = GpuTextModel::planned_bytes(config.text, model_options).workspace;
      model_options.lora_rank = rank;
      const size_t with = GpuTextModel::planned_bytes(config.text, model_options).workspace;
      std::printf("%s r %lld: text adapters' scratch %.1f MiB\n", preset, static_cast<long long>(rank),
                  static_cast<double>(with - without) / 1048576.0);
      EXPECT_EQ(with - without, estimate_text_lora_bytes(config.text, model_options.max_tokens, rank));
      const int64_t patches = 4096;
      const size_t v0 = GpuVisionModel::planned_bytes(config.vision, patches, 8, true, true).workspace;
      const size_t v1 = GpuVisionModel::planned_bytes(config.vision, patches, 8, true, true, rank).workspace;
      EXPECT_EQ(v1 - v0, estimate_vision_lora_bytes(patches, rank));
      // LoRA dropout: [rows, widest dense input] fp32 more, as memory_plan.cc counts it.
      model_options.lora_dropout_max_in = config.text.hidden_size;
      EXPECT_EQ(GpuTextModel::planned_bytes(config.text, model_options).workspace - with,
                lora_dropout_scratch_bytes(model_options.max_tokens, config.text.hidden_size));
      model_options.lora_dropout_max_in = 0;
      const int64_t wide = config.vision.merged_dim();
      EXPECT_EQ(GpuVisionModel::planned_bytes(config.vision, patches, 8, true, true, rank, 0, wide).workspace - v1,
                lora_dropout_scratch_bytes(patches, wide));
    }
  }
}

// The engine's exact plan of an all-linear LoRA run with images against the CPU planner.
TEST(GpuEngineLora, MemoryPlanMatchesTheCpuPlanner) {
  EngineOptions options = lora_engine_options(adapters({"all-linear"}, true, 8));
  options.max_image_pixels = 16 * 32 * 32;
  GpuEngine gpu(base_checkpoint(), options);
  const MemoryPlan& exact = gpu.memory_plan();
  // What the engine kept from the forward (it fits here: both), planned the same.
  EXPECT_TRUE(exact.keep_expert_rows && exact.keep_gdn_forward);
  options.recompute.keep_expert_rows = exact.keep_expert_rows;
  options.recompute.keep_gdn_forward = exact.keep_gdn_forward;
  const MemoryPlan cpu = plan_training_memory(base_checkpoint().config, options);
  std::printf("engine plan\n%sCPU planner\n%s", exact.describe().c_str(), cpu.describe().c_str());
  EXPECT_TRUE(exact.vit_trained && exact.merger_trained) << "adapters in the tower make it run a backward";
  EXPECT_EQ(exact.state(), cpu.state());
  EXPECT_EQ(exact.text.activations, cpu.text.activations);
  EXPECT_EQ(exact.vision.activations, cpu.vision.activations);
}

}  // namespace
}  // namespace deltamoe
