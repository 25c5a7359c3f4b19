// Acceptance of `parity --device cuda` (issue #7): for every golden case under tests/golden (text
// and VLM with images) the GPU run (run_parity_gpu, bf16 with fp32 accumulation) is compared with
// (1) the fp32 CPU reference with its routing PINNED to the GPU's top-k choices: losses within
// 1e-2, every gradient within max(2e-2, kWholeModelFactor x the CPU's own move under one bf16-sized
// change of the weights, pinned too), a bound never above kMaxGradBound (0.3): a gradient whose
// bound would exceed it is chaotic (one bf16 rounding of the weights moves the fp32 reference by
// more than 0.3 / 8) and is printed, not asserted; (2) transformers' expected.safetensors and the
// unpinned CPU run: losses within 1e-2 wherever the GPU routed every token as the CPU did (printed
// where bf16 flipped a near-tie: one flip moves a 29-token aux loss by ~1.7%), gradients printed,
// and both asserted (1e-2, 2e-2) on the cases fit for that bar:
// those where transformers itself, trained in bf16 mixed precision (torch.autocast), keeps every
// gradient within 2e-2 of its fp32 golden (<case>/bf16_floor.json, tools/golden/bf16_floor.py). At
// least one text and one VLM case must be fit, and a fit case may have no chaotic gradient, so every
// tensor is asserted within 0.3 (pinned) and, against transformers and the free CPU run, within
// max(2e-2, kAutocastFactor x transformers' own autocast error on that tensor) there: a bar 25% above
// what transformers' mixed precision itself gets on the tensor, so that a tensor bf16 already moves
// close to 2e-2 (vlm_gain015's visual.blocks.0.norm1.bias: 1.683e-2 under autocast) is held to the
// reference implementation's precision, not to a flat number the last bits land on either side of.
// Why: on tiny models one bf16 rounding per activation moves gate and norm gradients (sums over few
// tokens that cancel) by several percent; the older golden models (gain-1 matrices, router
// near-ties) move past 2e-2 even from bf16 weights alone (parity_bf16_sensitivity_test,
// docs/vision.md "bf16 parity and conditioning"); on
// text_8layer every ce gradient is chaotic (pinned bf16 move 0.05 to 5.0, measured on the CPU), so
// there the losses and the zero aux gradients are what is asserted. A zero reference gradient must
// be zero on the GPU (norm_ratio).
// Cases with images are also run with the ViT and the language model frozen (merger only).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <tuple>
#include <string>
#include <vector>

#include "checkpoint/model_checkpoint.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "train/golden_cases_test_util.h"
#include "train/gpu/gpu_parity.h"
#include "train/parity.h"
#include "train/parity_sensitivity.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

// bf16 weights and activations against fp32 references (the acceptance bounds).
constexpr double kLossRel = 1e-2;
constexpr double kGradRatio = 2e-2;
// Pinned comparison: a gradient may differ from the pinned CPU by kWholeModelFactor x the larger
// move of the pinned CPU itself under (a) every weight rounded to bf16 and (b) every weight scaled
// by (1 + u 2^-9); the GPU also rounds every activation (~10 per layer), which a weight change
// stands for only once. Measured (H200 run of 2026-12-02 against CPU runs here): on vlm_image_first,
// where bf16 weights flip no routing, GPU error / bf16-weight move had max 6.3 over 138 tensors;
// gpu_text_model_gpu_test's whole-model checks use 8 for the same reason. A wrong term, buffer or
// scale moves a gradient by O(1), far beyond that.
constexpr double kWholeModelFactor = 8.0;
// No gradient bound above this: an all-zero gradient is 1.0 away and a sign-flipped one 2.0, so a
// bound must stay well under 1 to mean anything. Where 8 x the sensitivity exceeds it, the fp32
// reference itself is not determined to this precision by bf16 weights: the gradient is chaotic.
constexpr double kMaxGradBound = 0.3;
// A fit case's gradient may be this many times transformers' own autocast error on the tensor, where
// that is above 2e-2 (header).
constexpr double kAutocastFactor = 1.25;
constexpr double kWeightPerturbation = 1.0 / 512.0;
constexpr uint64_t kPerturbationSeed = 20261202;

// What bf16 costs transformers on one case, from <case>/bf16_floor.json (absent: not measured).
struct Conditioning {
  bool measured = false;
  double autocast_worst = 0, bf16_worst = 0;  // worst gradient ||diff||/||ref|| of each mode
  std::string autocast_worst_name;
  std::map<std::string, double> autocast_grads;  // "grad." / "grad_aux." + name -> its error under autocast
  bool fit() const { return measured && autocast_worst <= kGradRatio; }
};

Conditioning read_conditioning(const fs::path& dir) {
  Conditioning conditioning;
  const fs::path file = dir / "bf16_floor.json";
  if (!fs::exists(file)) return conditioning;
  std::ifstream stream(file);
  const nlohmann::json json = nlohmann::json::parse(stream, nullptr, /*allow_exceptions=*/false);
  CHECK(json.is_object() && json.contains("modes") && json["modes"].contains("autocast") &&
            json["modes"].contains("bf16"),
        file.string(), ": not a bf16_floor.py summary (no modes.autocast / modes.bf16)");
  conditioning.measured = true;
  conditioning.autocast_worst = json["modes"]["autocast"].at("worst").get<double>();
  conditioning.autocast_worst_name = json["modes"]["autocast"].at("worst_name").get<std::string>();
  conditioning.bf16_worst = json["modes"]["bf16"].at("worst").get<double>();
  const nlohmann::json& grads = json["modes"]["autocast"].at("gradients");
  CHECK(grads.is_object() && !grads.empty(), file.string(), ": modes.autocast.gradients is not a map of errors");
  for (const auto& [name, error] : grads.items()) conditioning.autocast_grads[name] = error.get<double>();
  return conditioning;
}

using golden_test::golden_cases;
using golden_test::golden_dir;

// A reference in the result's terms: losses and gradients by name ("grad." / "grad_aux." maps).
struct Reference {
  std::string label;
  double ce_loss = 0, aux_loss = 0;
  std::map<std::string, std::vector<float>> grads, grads_aux;
};

// How a comparison is judged: gradients asserted or only printed; per-tensor bounds (by "grad." /
// "grad_aux." + name, from the measured sensitivity, each <= kMaxGradBound) override kGradRatio
// where given; chaotic tensors (their bound would exceed kMaxGradBound) are printed, not asserted.
struct Judgement {
  bool assert_grads = true;
  bool assert_losses = true;
  std::map<std::string, double> bounds;
  std::map<std::string, double> sensitivity;  // printed next to the bound
  std::set<std::string> chaotic;
};

std::vector<float> values_of(const HostTensor& tensor) {
  const HostTensor f32 = tensor.to_f32();
  return std::vector<float>(f32.as<float>(), f32.as<float>() + f32.numel());
}

Reference reference_from_result(const std::string& label, const ParityResult& result) {
  Reference ref{label, result.ce_loss, result.aux_loss, {}, {}};
  for (const auto& [name, grad] : result.grads) ref.grads[name] = values_of(grad);
  for (const auto& [name, grad] : result.grads_aux) ref.grads_aux[name] = values_of(grad);
  return ref;
}

Reference reference_from_golden(const fs::path& file) {
  const auto expected = SafetensorsFile::open(file.string());
  Reference ref;
  ref.label = "golden";
  ref.ce_loss = values_of(expected->tensor("ce_loss").to_host())[0];
  ref.aux_loss = values_of(expected->tensor("aux_loss").to_host())[0];
  for (const SafetensorsEntry& entry : expected->entries()) {
    for (const auto& [kind, target] : {std::pair{std::string("grad."), &ref.grads},
                                       std::pair{std::string("grad_aux."), &ref.grads_aux}}) {
      if (entry.name.rfind(kind, 0) == 0)
        (*target)[entry.name.substr(kind.size())] = values_of(expected->tensor(entry.name).to_host());
    }
  }
  return ref;
}

// ||ours - ref|| / ||ref||; a zero reference must be matched by zero.
double norm_ratio(const float* ours, const std::vector<float>& ref, bool* finite) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(ours[i])) *finite = false;
    diff += (double(ours[i]) - ref[i]) * (double(ours[i]) - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  if (norm == 0) return diff == 0 ? 0.0 : INFINITY;
  return std::sqrt(diff / norm);
}

double bound_or_default(const Judgement& judgement, const std::string& key) {
  const auto found = judgement.bounds.find(key);
  return found != judgement.bounds.end() ? found->second : kGradRatio;
}

// The pinned comparison's bounds: the CPU reference (routing forced as in `pinned`) rerun with
// bf16-rounded and with perturbed weights; each gradient's sensitivity is the larger move, its
// bound max(kGradRatio, kWholeModelFactor x sensitivity), or chaotic where that exceeds kMaxGradBound.
Judgement measured_bounds(const ModelCheckpoint& checkpoint, const ParityInputs& pinned, const ParityResult& cpu,
                          const TrainableParts& trainable) {
  const ParityResult rounded = run_parity_cpu(with_bf16_rounded_weights(checkpoint), pinned, trainable);
  const ParityResult perturbed =
      run_parity_cpu(with_perturbed_weights(checkpoint, kWeightPerturbation, kPerturbationSeed), pinned, trainable);
  Judgement judgement;
  for (const auto& [kind, ref, moved_a, moved_b] :
       {std::tuple{std::string("grad."), &cpu.grads, &rounded.grads, &perturbed.grads},
        std::tuple{std::string("grad_aux."), &cpu.grads_aux, &rounded.grads_aux, &perturbed.grads_aux}}) {
    const std::map<std::string, double> a = gradient_distances(*moved_a, *ref);
    const std::map<std::string, double> b = gradient_distances(*moved_b, *ref);
    for (const auto& [name, distance] : a) {
      const double sensitivity = std::max(distance, b.at(name));
      const double bound = std::max(kGradRatio, kWholeModelFactor * sensitivity);
      judgement.sensitivity[kind + name] = sensitivity;
      if (bound <= kMaxGradBound) {
        judgement.bounds[kind + name] = bound;
      } else {
        judgement.chaotic.insert(kind + name);
      }
    }
  }
  return judgement;
}

void compare_with(const std::string& case_name, const ParityResult& gpu, const Reference& ref,
                  const Judgement& judgement = {}) {
  const double ce_err = std::abs(gpu.ce_loss - ref.ce_loss) / std::max(std::abs(ref.ce_loss), 1e-12);
  const double aux_err = std::abs(gpu.aux_loss - ref.aux_loss) / std::max(std::abs(ref.aux_loss), 1e-12);
  std::printf("  %s vs %s: ce_loss %.6f vs %.6f (rel %.2e), aux_loss %.6f vs %.6f (rel %.2e)\n", case_name.c_str(),
              ref.label.c_str(), gpu.ce_loss, ref.ce_loss, ce_err, gpu.aux_loss, ref.aux_loss, aux_err);
  if (judgement.assert_losses) {
    EXPECT_LE(ce_err, kLossRel) << case_name << " vs " << ref.label << ": ce_loss";
    EXPECT_LE(aux_err, kLossRel) << case_name << " vs " << ref.label << ": aux_loss";
  } else {
    std::printf("  %s vs %s: losses printed, not asserted (the GPU flipped near-tie routing decisions)\n",
                case_name.c_str(), ref.label.c_str());
  }
  for (const auto& [kind, ours, theirs] :
       {std::tuple{"grad.", &gpu.grads, &ref.grads}, std::tuple{"grad_aux.", &gpu.grads_aux, &ref.grads_aux}}) {
    double worst = 0, worst_vision = -1, worst_margin = INFINITY;
    std::string worst_name = "(none)", worst_vision_name, worst_margin_name;
    int over = 0, num_chaotic = 0;
    for (const auto& [name, ref_values] : *theirs) {
      const auto found = ours->find(name);
      if (found == ours->end()) {
        ADD_FAILURE() << case_name << " vs " << ref.label << ": " << kind << name << " missing from the GPU run";
        continue;
      }
      ASSERT_EQ(found->second.numel(), static_cast<int64_t>(ref_values.size())) << kind << name;
      const HostTensor f32 = found->second.to_f32();
      bool finite = true;
      const double ratio = norm_ratio(f32.as<float>(), ref_values, &finite);
      const double score = finite ? ratio : INFINITY;
      const auto bound_found = judgement.bounds.find(kind + name);
      const double bound = bound_found != judgement.bounds.end() ? bound_found->second : kGradRatio;
      EXPECT_TRUE(finite) << case_name << ": " << kind << name << " not finite";
      if (score > worst || worst_name == "(none)") worst = score, worst_name = name;
      if (name.rfind("model.visual.", 0) == 0 && score > worst_vision) worst_vision = score, worst_vision_name = name;
      if (judgement.chaotic.count(kind + name)) {
        ++num_chaotic;
        continue;  // no bound (see kMaxGradBound): not asserted, not in `over` or the margins
      }
      if (judgement.assert_grads) {
        const auto sens = judgement.sensitivity.find(kind + name);
        EXPECT_LE(score, bound) << case_name << " vs " << ref.label << ": " << kind << name << " (bound " << bound
                                << ", bf16 sensitivity "
                                << (sens != judgement.sensitivity.end() ? sens->second : 0.0) << ")";
      }
      over += score > bound;
      if (bound / std::max(score, 1e-30) < worst_margin)
        worst_margin = bound / std::max(score, 1e-30), worst_margin_name = name;
    }
    for (const auto& [name, tensor] : *ours)
      EXPECT_TRUE(theirs->count(name)) << case_name << ": the GPU run has " << kind << name << ", " << ref.label
                                       << " does not";
    std::printf("  %s vs %s: %zu %s tensors, worst ||diff||/||ref|| %.3e (%s), %d over %s%s\n", case_name.c_str(),
                ref.label.c_str(), theirs->size(), kind, worst, worst_name.c_str(), over,
                judgement.bounds.empty() ? str_cat(kGradRatio).c_str() : "their bounds",
                judgement.assert_grads ? "" : " (printed, not asserted)");
    if (num_chaotic > 0)
      std::printf("  %s vs %s: %d %s tensors chaotic (%g x their bf16 sensitivity > %g), printed, not asserted\n",
                  case_name.c_str(), ref.label.c_str(), num_chaotic, kind, kWholeModelFactor, kMaxGradBound);
    if (!judgement.bounds.empty() && !worst_margin_name.empty()) {
      const std::string key = kind + worst_margin_name;
      const auto sens = judgement.sensitivity.find(key);
      std::printf("  %s vs %s: closest to its bound: %s%s bound %.3e (bf16 sensitivity %.3e), bound / error %.2f\n",
                  case_name.c_str(), ref.label.c_str(), kind, worst_margin_name.c_str(),
                  bound_or_default(judgement, key),
                  sens != judgement.sensitivity.end() ? sens->second : 0.0, worst_margin);
    }
    if (worst_vision >= 0)
      std::printf("  %s vs %s: worst vision %s tensor %.3e (%s)\n", case_name.c_str(), ref.label.c_str(), kind,
                  worst_vision, worst_vision_name.c_str());
  }
}

TEST(GpuParityGolden, PinnedCpuWithinCappedBoundsEveryCaseTransformersWithin2e2OnFitCases) {
  const std::vector<fs::path> cases = golden_cases();
  ASSERT_FALSE(cases.empty()) << "no golden cases under " << golden_dir();
  int with_images = 0, fit_text = 0, fit_images = 0;
  for (const fs::path& dir : cases) {
    const std::string name = dir.filename().string();
    SCOPED_TRACE(name);
    const ModelCheckpoint checkpoint = load_model_dir((dir / "model").string());
    const ParityInputs inputs = load_parity_inputs((dir / "inputs.safetensors").string());
    const Conditioning conditioning = read_conditioning(dir);
    const bool strict = conditioning.fit();
    (inputs.pixel_values ? fit_images : fit_text) += strict;
    std::printf("%s: %s%s\n", name.c_str(),
                inputs.pixel_values ? str_cat(inputs.image_grid_thw->shape()[0], " images").c_str() : "text only",
                strict ? ", fit for 2e-2 (golden and CPU gradients asserted to it)" : "");
    if (conditioning.measured)
      std::printf("  %s: transformers' own worst gradient error in bf16: autocast %.3e (%s), pure bf16 %.3e\n",
                  name.c_str(), conditioning.autocast_worst, conditioning.autocast_worst_name.c_str(),
                  conditioning.bf16_worst);
    const ParityResult gpu = run_parity_gpu(checkpoint, inputs);
    const ParityResult cpu = run_parity_cpu(checkpoint, inputs);
    const int64_t flips = routing_differences(gpu.routing, cpu.routing, checkpoint.config.text.num_experts_per_tok);
    std::printf("  %s: the GPU's top-k expert set differs from the CPU's on %lld of %lld (layer, token) pairs\n",
                name.c_str(), static_cast<long long>(flips),
                static_cast<long long>(checkpoint.config.text.num_hidden_layers * inputs.input_ids.numel()));
    // (1) The comparison that holds in bf16 on any case: the CPU follows the GPU's routing.
    ParityInputs pinned = inputs;
    pinned.forced_routing = gpu.routing;
    const ParityResult cpu_pinned = run_parity_cpu(checkpoint, pinned);
    const Judgement pinned_bounds = measured_bounds(checkpoint, pinned, cpu_pinned, {});
    compare_with(name, gpu, reference_from_result("cpu pinned to the GPU's routing", cpu_pinned), pinned_bounds);
    // A case fit for 2e-2 must have a bound on every gradient, so that there every tensor is checked.
    if (strict) {
      EXPECT_TRUE(pinned_bounds.chaotic.empty())
          << name << ": fit for 2e-2 but " << pinned_bounds.chaotic.size() << " gradients are chaotic, first "
          << *pinned_bounds.chaotic.begin();
    }
    // (2) Unpinned: on near-tie routers a flipped token moves every gradient upstream, so these
    // gradients are printed only, except on the well-conditioned cases. The losses are asserted
    // where the GPU routed every token as the CPU did (always on the fit cases): one flipped top-k
    // decision among T tokens moves the aux loss by ~1/(T K) of an expert's share, 1.7% on the
    // 29-token image cases, so there the bar is below the resolution of one routing decision (and
    // (1) asserts both losses with the routing pinned).
    Judgement unpinned;
    unpinned.assert_grads = strict;
    if (strict) {
      for (const auto& [key, error] : conditioning.autocast_grads)
        unpinned.bounds[key] = std::max(kGradRatio, kAutocastFactor * error);
    }
    unpinned.assert_losses = strict || flips == 0;
    compare_with(name, gpu, reference_from_golden(dir / "expected.safetensors"), unpinned);
    compare_with(name, gpu, reference_from_result("cpu", cpu), unpinned);
    if (!inputs.pixel_values) continue;
    ++with_images;
    // Frozen ViT and language model: only the merger's gradients, against the CPU pinned to the
    // frozen GPU run's routing (and printed against the free CPU run).
    TrainableParts merger_only;
    merger_only.vit = merger_only.llm = false;
    const ParityResult gpu_frozen = run_parity_gpu(checkpoint, inputs, merger_only);
    ParityInputs frozen_pinned = inputs;
    frozen_pinned.forced_routing = gpu_frozen.routing;
    const ParityResult cpu_frozen_pinned = run_parity_cpu(checkpoint, frozen_pinned, merger_only);
    compare_with(name + " (merger only)", gpu_frozen,
                 reference_from_result("cpu pinned to the GPU's routing", cpu_frozen_pinned),
                 measured_bounds(checkpoint, frozen_pinned, cpu_frozen_pinned, merger_only));
    compare_with(name + " (merger only)", gpu_frozen,
                 reference_from_result("cpu", run_parity_cpu(checkpoint, inputs, merger_only)), unpinned);
    EXPECT_EQ(gpu_frozen.grads.size(), 6u) << "the merger has 6 tensors";
  }
  std::printf("%zu cases, %d with images; fit for 2e-2: %d text, %d with images\n", cases.size(), with_images,
              fit_text, fit_images);
  EXPECT_GT(with_images, 0) << "no golden case with images";
  EXPECT_GT(fit_text, 0) << "no text-only golden case fit for 2e-2 (bf16_floor.json autocast worst <= 2e-2)";
  EXPECT_GT(fit_images, 0) << "no golden case with images fit for 2e-2 (bf16_floor.json autocast worst <= 2e-2)";
}

// Inputs the CPU run refuses, the GPU run refuses too (before any device work), with a message.
TEST(GpuParityGolden, RefusesWhatTheCpuRunRefuses) {
  const fs::path vlm = fs::path(golden_dir()) / "vlm_two_images";
  const fs::path text = fs::path(golden_dir()) / "text_two_rows";
  ASSERT_TRUE(fs::is_directory(vlm) && fs::is_directory(text)) << "golden cases missing under " << golden_dir();
  const ModelCheckpoint vlm_model = load_model_dir((vlm / "model").string());
  const ModelCheckpoint text_model = load_model_dir((text / "model").string());
  const ParityInputs images = load_parity_inputs((vlm / "inputs.safetensors").string());
  ParityInputs no_grid = images;
  no_grid.image_grid_thw.reset();
  ParityInputs short_pixels = images;
  const int64_t rows = images.pixel_values->shape()[0] - 4, cols = images.pixel_values->shape()[1];
  short_pixels.pixel_values = HostTensor::from_f32(
      std::vector<float>(images.pixel_values->as<float>(), images.pixel_values->as<float>() + rows * cols),
      Shape{rows, cols});
  struct Bad {
    const char* what;
    const ModelCheckpoint* model;
    const ParityInputs* inputs;
  };
  for (const Bad& bad : {Bad{"pixel_values without image_grid_thw", &vlm_model, &no_grid},
                         Bad{"images for a text-only model", &text_model, &images},
                         Bad{"one merge block of pixel_values missing", &vlm_model, &short_pixels}}) {
    EXPECT_THROW(run_parity_cpu(*bad.model, *bad.inputs), Error) << bad.what;
    try {
      run_parity_gpu(*bad.model, *bad.inputs);
      ADD_FAILURE() << bad.what << ": the GPU run accepted it";
    } catch (const Error& error) {
      std::printf("  %s: %s\n", bad.what, error.what());
    }
  }
}

}  // namespace
}  // namespace deltamoe
