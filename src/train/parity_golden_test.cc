// Golden parity of the CPU reference against transformers: for every case under tests/golden (text
// and VLM with images), runs run_parity_cpu and compares with expected.safetensors: ce_loss,
// aux_loss within 1e-5 relative; logits max|diff| / max|ref| <= 2e-5 (1e-6 on the well-conditioned
// *_router_margin cases); every gradient (vision ones included) ||diff|| / ||ref|| <= 1e-4. Prints
// each case's worst tensor.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>

#include "checkpoint/model_checkpoint.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "train/golden_cases_test_util.h"
#include "train/parity.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

constexpr double kLossTolerance = 1e-5, kGradTolerance = 1e-4;
// Logits max|diff| / max|ref| observed (fp32 here against fp32 transformers): 2.3e-7 to
// 3.7e-7 on the *_router_margin cases, 2.2e-6 to 8.2e-6 on the gain-1 ones (text_8layer worst).
// rope_theta off by 1e-3 gives 1.5e-6 to 6.4e-6 on the first and 2.0e-5 to 5.8e-5 on three of the
// second, so each bound sits ~2.5x above what is observed.
constexpr double kLogitsTolerance = 2e-5, kConditionedLogitsTolerance = 1e-6;

bool well_conditioned(const std::string& case_name) { return case_name.ends_with("_router_margin"); }

using golden_test::golden_cases;
using golden_test::golden_dir;

std::vector<float> f32_values(const StoredTensor& tensor) {
  const HostTensor host = tensor.to_host().to_f32();
  return std::vector<float>(host.as<float>(), host.as<float>() + host.numel());
}

struct Worst {
  double error = 0;
  std::string name;
  void update(double value, const std::string& tensor) {
    if (value > error || name.empty()) error = value, name = tensor;
  }
};

double norm_ratio(const std::vector<float>& ours, const std::vector<float>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff += (double(ours[i]) - ref[i]) * (double(ours[i]) - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  if (norm == 0) return diff == 0 ? 0.0 : INFINITY;
  return std::sqrt(diff / norm);
}

void check_case(const fs::path& dir) {
  const std::string name = dir.filename().string();
  const ModelCheckpoint checkpoint = load_model_dir((dir / "model").string());
  const ParityInputs inputs = load_parity_inputs((dir / "inputs.safetensors").string());
  const ParityResult result = run_parity_cpu(checkpoint, inputs);
  std::printf("  %s: %s, %zu gradient tensors per loss\n", name.c_str(),
              inputs.pixel_values ? str_cat(inputs.image_grid_thw->shape()[0], " images").c_str() : "text only",
              result.grads.size());
  const auto expected = SafetensorsFile::open((dir / "expected.safetensors").string());

  const double ce_ref = f32_values(expected->tensor("ce_loss"))[0];
  const double aux_ref = f32_values(expected->tensor("aux_loss"))[0];
  const double ce_err = std::abs(result.ce_loss - ce_ref) / std::abs(ce_ref);
  const double aux_err = std::abs(result.aux_loss - aux_ref) / std::abs(aux_ref);
  std::printf("  %s: ce_loss %.8f vs %.8f (rel %.2e), aux_loss %.8f vs %.8f (rel %.2e)\n", name.c_str(), result.ce_loss,
              ce_ref, ce_err, result.aux_loss, aux_ref, aux_err);
  EXPECT_LE(ce_err, kLossTolerance) << name;
  EXPECT_LE(aux_err, kLossTolerance) << name;

  const std::vector<float> logits_ref = f32_values(expected->tensor("logits"));
  ASSERT_EQ(static_cast<int64_t>(logits_ref.size()), result.logits.numel()) << name << ": logits size";
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < logits_ref.size(); ++i) {
    max_diff = std::max(max_diff, std::abs(double(result.logits.as<float>()[i]) - logits_ref[i]));
    max_ref = std::max(max_ref, std::abs(double(logits_ref[i])));
  }
  std::printf("  %s: logits max|diff| %.3e / max|ref| %.3e = %.3e\n", name.c_str(), max_diff, max_ref,
              max_diff / max_ref);
  EXPECT_LE(max_diff / max_ref, well_conditioned(name) ? kConditionedLogitsTolerance : kLogitsTolerance) << name;

  // Every expected gradient must be ours and match; ours without a reference must be all zero.
  for (const auto& [kind, ours] : {std::pair{"grad.", &result.grads}, std::pair{"grad_aux.", &result.grads_aux}}) {
    Worst worst, worst_vision;
    std::set<std::string> seen;
    for (const SafetensorsEntry& entry : expected->entries()) {
      if (entry.name.rfind(kind, 0) != 0) continue;
      const std::string param = entry.name.substr(std::string(kind).size());
      seen.insert(param);
      auto it = ours->find(param);
      if (it == ours->end()) {
        ADD_FAILURE() << name << ": expected " << entry.name << " has no counterpart";
        continue;
      }
      const std::vector<float> ref = f32_values(expected->tensor(entry.name));
      ASSERT_EQ(static_cast<int64_t>(ref.size()), it->second.numel()) << name << ": " << entry.name << " size";
      const std::vector<float> mine(it->second.as<float>(), it->second.as<float>() + it->second.numel());
      const double error = norm_ratio(mine, ref);
      worst.update(error, param);
      if (param.rfind("model.visual.", 0) == 0) worst_vision.update(error, param);
      EXPECT_LE(error, kGradTolerance) << name << ": " << entry.name;
    }
    for (const auto& [param, tensor] : *ours) {
      if (seen.count(param)) continue;
      double norm = 0;
      for (int64_t i = 0; i < tensor.numel(); ++i) norm += std::abs(tensor.as<float>()[i]);
      EXPECT_EQ(norm, 0.0) << name << ": " << kind << param << " is nonzero but absent from the reference";
    }
    std::printf("  %s: %zu %s tensors, worst ||diff||/||ref|| %.3e (%s)\n", name.c_str(), seen.size(), kind,
                worst.error, worst.name.c_str());
    if (!worst_vision.name.empty()) {
      std::printf("  %s: worst vision %s tensor %.3e (%s)\n", name.c_str(), kind, worst_vision.error,
                  worst_vision.name.c_str());
    }
  }
}

TEST(ParityGolden, AllCasesMatchTransformers) {
  const std::vector<fs::path> cases = golden_cases();
  ASSERT_FALSE(cases.empty()) << "no golden cases under " << golden_dir()
                              << " (tools/golden/make_golden.py writes them)";
  int with_images = 0;
  for (const fs::path& dir : cases) {
    check_case(dir);
    with_images += SafetensorsFile::open((dir / "inputs.safetensors").string())->contains("pixel_values");
  }
  std::printf("  %zu cases, %d with images\n", cases.size(), with_images);
}

}  // namespace
}  // namespace deltamoe
