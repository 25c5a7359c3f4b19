// LoRA golden parity against PEFT (tools/golden/lora_golden.py, files under tests/golden/lora/<case>):
// PEFT LoRA on all-linear and on the experts' fused weights over a committed tiny golden model.
// Checks that deltamoe resolves the same targets under PEFT's key names and shapes, reads PEFT's
// adapter directory, and that the CPU reference's ce_loss, aux_loss, logits and every adapter
// gradient (both losses) match PEFT's within 1e-4, and the merged weights (export --merge_lora)
// PEFT's merge_and_unload(). The cases are skipped, saying how to make them, until the files exist.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "checkpoint/model_checkpoint.h"
#include "checkpoint/peft_adapter.h"
#include "checkpoint/safetensors.h"
#include "train/golden_cases_test_util.h"
#include "train/parity.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

constexpr double kTolerance = 1e-4;       // losses, logits and gradients: max|diff| / max(max|ref|, 1e-6)
constexpr double kMergeTolerance = 1e-5;  // merged weights

std::vector<float> values_of(const HostTensor& tensor) {
  const HostTensor f = tensor.to_f32();
  return std::vector<float>(f.as<float>(), f.as<float>() + f.numel());
}

double rel_max_diff(const std::vector<float>& ours, const std::vector<float>& ref) {
  if (ours.size() != ref.size()) return INFINITY;
  double diff = 0, scale = 1e-6;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, std::abs(double(ours[i]) - ref[i]));
    scale = std::max(scale, std::abs(double(ref[i])));
  }
  return diff / scale;
}

void check_case(const std::string& name) {
  const fs::path dir = fs::path(golden_test::golden_dir()) / "lora" / name;
  if (!fs::exists(dir / "expected.safetensors")) {
    GTEST_SKIP() << "NOT CHECKED: " << dir.string() << " is missing; make it on the GPU machine with "
                 << "`bash tools/gpu/run_lora_golden.sh golden` and unpack lora_golden.tar.gz with tar -C tests -xzf";
  }
  std::ifstream in(dir / "case.json");
  const nlohmann::json meta = nlohmann::json::parse(in);
  const fs::path base_dir = fs::path(golden_test::golden_dir()) / meta.at("base_case").get<std::string>();
  const ModelCheckpoint checkpoint = load_model_dir((base_dir / "model").string());
  const ParityInputs inputs = load_parity_inputs((base_dir / "inputs.safetensors").string());

  // 1. all-linear + the experts resolve to PEFT's targets: the same keys and shapes.
  LoraOptions options;
  options.rank = meta.at("r").get<int64_t>();
  options.alpha = meta.at("lora_alpha").get<double>();
  options.use_rslora = meta.at("use_rslora").get<bool>();
  options.target_modules = {"all-linear"};
  options.target_parameters = meta.at("target_parameters").get<std::vector<std::string>>();
  const LoraAdapters ours = init_lora_adapters(checkpoint.config, options, 1);
  std::map<std::string, std::vector<int64_t>> our_keys;
  for (const LoraTarget& t : ours.targets) {
    our_keys[peft_adapter_key(t, ours.targets, "lora_A")] = t.a_shape(options.rank);
    our_keys[peft_adapter_key(t, ours.targets, "lora_B")] = t.b_shape(options.rank);
  }
  std::map<std::string, std::vector<int64_t>> peft_keys;
  for (const auto& [key, shape] : meta.at("adapter_shapes").items()) peft_keys[key] = shape.get<std::vector<int64_t>>();
  for (const auto& [key, shape] : peft_keys) {
    EXPECT_TRUE(our_keys.count(key)) << "PEFT adapts " << key << ", deltamoe does not";
    if (our_keys.count(key)) {
      EXPECT_EQ(our_keys.at(key), shape) << key;
    }
  }
  for (const auto& [key, shape] : our_keys) EXPECT_TRUE(peft_keys.count(key)) << "deltamoe adapts " << key << ", PEFT does not";

  // 2. PEFT's adapter directory on the CPU reference.
  const LoraAdapters adapters = load_peft_adapter((dir / "adapter").string(), checkpoint.config);
  EXPECT_NEAR(adapters.options.scaling(), options.scaling(), 1e-12);
  const ParityResult result = run_parity_cpu(checkpoint, inputs, {}, &adapters);
  const auto expected = SafetensorsFile::open((dir / "expected.safetensors").string());
  auto ref = [&](const std::string& key) { return values_of(expected->tensor(key).to_host()); };
  const double ce = ref("ce_loss")[0], aux = ref("aux_loss")[0];
  EXPECT_NEAR(result.ce_loss, ce, kTolerance * std::max(1.0, std::abs(ce)));
  EXPECT_NEAR(result.aux_loss, aux, kTolerance * std::max(1.0, std::abs(aux)));
  const double logits = rel_max_diff(values_of(result.logits), ref("logits"));
  EXPECT_LT(logits, kTolerance);
  double worst = 0;
  std::string worst_name;
  int checked = 0;
  for (const SafetensorsEntry& entry : expected->entries()) {
    for (const auto& [prefix, grads] : {std::pair{std::string("grad."), &result.grads},
                                        std::pair{std::string("grad_aux."), &result.grads_aux}}) {
      if (!entry.name.starts_with(prefix)) continue;
      const std::string key = entry.name.substr(prefix.size());
      auto it = grads->find(key);
      EXPECT_TRUE(it != grads->end()) << "no deltamoe gradient for " << key;
      if (it == grads->end()) continue;
      const double error = rel_max_diff(values_of(it->second), ref(entry.name));
      EXPECT_LT(error, kTolerance) << entry.name;
      if (error > worst) worst = error, worst_name = entry.name;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 2 * static_cast<int>(peft_keys.size()));

  // 3. Merging (export --merge_lora) against merge_and_unload().
  const ModelCheckpoint merged = merge_lora(checkpoint, adapters);
  double merge_worst = 0;
  int merged_checked = 0;
  for (const SafetensorsEntry& entry : expected->entries()) {
    if (!entry.name.starts_with("merged.")) continue;
    const std::string param = entry.name.substr(7);
    auto it = merged.params.find(param);
    EXPECT_TRUE(it != merged.params.end()) << param;
    if (it == merged.params.end()) continue;
    const double error = rel_max_diff(values_of(it->second.to_host()), ref(entry.name));
    EXPECT_LT(error, kMergeTolerance) << param;
    merge_worst = std::max(merge_worst, error);
    ++merged_checked;
  }
  EXPECT_EQ(merged_checked, static_cast<int>(adapters.targets.size()));
  std::printf("  %s: ce %.6f (PEFT %.6f), logits %.2e, %d adapter gradients worst %.2e (%s), %d merged weights "
              "worst %.2e\n",
              name.c_str(), result.ce_loss, ce, logits, checked, worst, worst_name.c_str(), merged_checked,
              merge_worst);
}

TEST(LoraGolden, TextAllLinearAndExperts) { check_case("text_lora"); }
TEST(LoraGolden, VlmAllLinearAndExpertsRsLora) { check_case("vlm_lora"); }

}  // namespace
}  // namespace deltamoe
