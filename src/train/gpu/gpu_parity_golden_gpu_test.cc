// Acceptance of `parity --device cuda` (issue #7): for every golden case under tests/golden (text
// and VLM with images) the GPU run (run_parity_gpu, bf16 with fp32 accumulation) is compared with
// transformers' expected.safetensors AND with the fp32 CPU reference run_parity_cpu: ce_loss and
// aux_loss within 1e-2 relative, every gradient ||diff|| / ||ref|| <= 2e-2, the same gradient
// names. Cases with images are also run with the ViT and the language model frozen (merger only).
// Prints, per case and reference, the loss errors and the worst gradient with its tensor name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <tuple>
#include <string>
#include <vector>

#include "checkpoint/model_checkpoint.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "train/gpu/gpu_parity.h"
#include "train/parity.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

// bf16 weights and activations against fp32 references (the brief's acceptance bounds).
constexpr double kLossRel = 1e-2;
constexpr double kGradRatio = 2e-2;

std::string golden_dir() {
  const char* source = std::getenv("DELTAMOE_SOURCE_DIR");
  return (fs::path(source != nullptr ? source : ".") / "tests" / "golden").string();
}

std::vector<fs::path> golden_cases() {
  std::vector<fs::path> cases;
  if (!fs::is_directory(golden_dir())) return cases;
  for (const auto& entry : fs::directory_iterator(golden_dir())) {
    const fs::path dir = entry.path();
    if (fs::exists(dir / "expected.safetensors") && fs::exists(dir / "inputs.safetensors") &&
        fs::is_directory(dir / "model"))
      cases.push_back(dir);
  }
  std::sort(cases.begin(), cases.end());
  return cases;
}

// A reference in the result's terms: losses and gradients by name ("grad." / "grad_aux." maps).
struct Reference {
  std::string label;
  double ce_loss = 0, aux_loss = 0;
  std::map<std::string, std::vector<float>> grads, grads_aux;
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

void compare_with(const std::string& case_name, const ParityResult& gpu, const Reference& ref) {
  const double ce_err = std::abs(gpu.ce_loss - ref.ce_loss) / std::max(std::abs(ref.ce_loss), 1e-12);
  const double aux_err = std::abs(gpu.aux_loss - ref.aux_loss) / std::max(std::abs(ref.aux_loss), 1e-12);
  std::printf("  %s vs %s: ce_loss %.6f vs %.6f (rel %.2e), aux_loss %.6f vs %.6f (rel %.2e)\n", case_name.c_str(),
              ref.label.c_str(), gpu.ce_loss, ref.ce_loss, ce_err, gpu.aux_loss, ref.aux_loss, aux_err);
  EXPECT_LE(ce_err, kLossRel) << case_name << " vs " << ref.label << ": ce_loss";
  EXPECT_LE(aux_err, kLossRel) << case_name << " vs " << ref.label << ": aux_loss";
  for (const auto& [kind, ours, theirs] :
       {std::tuple{"grad.", &gpu.grads, &ref.grads}, std::tuple{"grad_aux.", &gpu.grads_aux, &ref.grads_aux}}) {
    double worst = 0, worst_vision = -1;
    std::string worst_name = "(none)", worst_vision_name;
    int over = 0;
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
      EXPECT_TRUE(finite) << case_name << ": " << kind << name << " not finite";
      EXPECT_LE(score, kGradRatio) << case_name << " vs " << ref.label << ": " << kind << name;
      over += score > kGradRatio;
      if (score > worst || worst_name == "(none)") worst = score, worst_name = name;
      if (name.rfind("model.visual.", 0) == 0 && score > worst_vision) worst_vision = score, worst_vision_name = name;
    }
    for (const auto& [name, tensor] : *ours)
      EXPECT_TRUE(theirs->count(name)) << case_name << ": the GPU run has " << kind << name << ", " << ref.label
                                       << " does not";
    std::printf("  %s vs %s: %zu %s tensors, worst ||diff||/||ref|| %.3e (%s)%s\n", case_name.c_str(),
                ref.label.c_str(), theirs->size(), kind, worst, worst_name.c_str(),
                over > 0 ? str_cat(", ", over, " over ", kGradRatio).c_str() : "");
    if (worst_vision >= 0)
      std::printf("  %s vs %s: worst vision %s tensor %.3e (%s)\n", case_name.c_str(), ref.label.c_str(), kind,
                  worst_vision, worst_vision_name.c_str());
  }
}

TEST(GpuParityGolden, EveryCaseMatchesTransformersAndTheCpuReference) {
  const std::vector<fs::path> cases = golden_cases();
  ASSERT_FALSE(cases.empty()) << "no golden cases under " << golden_dir();
  int with_images = 0;
  for (const fs::path& dir : cases) {
    const std::string name = dir.filename().string();
    SCOPED_TRACE(name);
    const ModelCheckpoint checkpoint = load_model_dir((dir / "model").string());
    const ParityInputs inputs = load_parity_inputs((dir / "inputs.safetensors").string());
    std::printf("%s: %s\n", name.c_str(),
                inputs.pixel_values ? str_cat(inputs.image_grid_thw->shape()[0], " images").c_str() : "text only");
    const ParityResult gpu = run_parity_gpu(checkpoint, inputs);
    compare_with(name, gpu, reference_from_golden(dir / "expected.safetensors"));
    compare_with(name, gpu, reference_from_result("cpu", run_parity_cpu(checkpoint, inputs)));
    if (!inputs.pixel_values) continue;
    ++with_images;
    // Frozen ViT and language model: only the merger's gradients, as the CPU run gives them.
    TrainableParts merger_only;
    merger_only.vit = merger_only.llm = false;
    const ParityResult gpu_frozen = run_parity_gpu(checkpoint, inputs, merger_only);
    compare_with(name + " (merger only)", gpu_frozen,
                 reference_from_result("cpu", run_parity_cpu(checkpoint, inputs, merger_only)));
    EXPECT_EQ(gpu_frozen.grads.size(), 6u) << "the merger has 6 tensors";
  }
  std::printf("%zu cases, %d with images\n", cases.size(), with_images);
  EXPECT_GT(with_images, 0) << "no golden case with images";
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
