// GpuTextModel with LoRA adapters on the attention and GDN projections, the shared expert and its
// gate (every Linear of the text model: all-linear) and on the routed experts' fused weights (PEFT's
// target_parameters) against the CPU reference
// TextModel with the same adapters attached (model/text/projection.h applies them): tiny config,
// bf16-rounded base and adapters (B nonzero, so every adapter product matters), the CPU's routing
// pinned to the GPU's. The base is frozen (no master, no gradient: DeviceParams trains only the
// adapters), so this is the LoRA step's model part: loss, per-layer activations and every adapter
// gradient within bounds measured the way gpu_text_model_gpu_test measures them (the CPU rerun with
// every weight moved by about one bf16 rounding), and the base weights bitwise unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <set>
#include <string>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "kernels/common/tensor_compare.h"
#include "model/gpu/device_params.h"
#include "model/lora/lora_adapters.h"
#include "model/param_table.h"
#include "model/text/gpu/gpu_text_model.h"
#include "model/text/text_batch.h"
#include "model/text/text_model.h"
#include "model/text/text_weights.h"

namespace deltamoe {
namespace {

constexpr double kMatrixStd = 0.05;           // as gpu_text_model_gpu_test (well-conditioned tiny model)
constexpr float kWeightPerturbation = 1.0f / 512.0f;
constexpr double kWholeModelFactor = 8.0;     // see gpu_text_model_gpu_test for the derivation
constexpr double kActivationFloor = 1e-2;
constexpr double kGradFloor = 2e-2;
constexpr double kLossRel = 1e-2;
constexpr double kMaxBound = 0.3;

const std::vector<std::string> kTargets = {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv",
                                           "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"};
// The shared expert's Linears (mlp.shared_expert.gate/up/down_proj) and its sigmoid gate.
const std::vector<std::string> kSharedExpertTargets = {"gate_proj", "up_proj", "down_proj", "shared_expert_gate"};

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

ParamMap perturbed(const ParamMap& params, uint32_t seed) {
  ParamMap out = params;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (auto& [name, tensor] : out) {
    if (ends_with(name, ".lora_scaling")) continue;
    for (float& v : tensor.values) v *= 1.0f + kWeightPerturbation * unit(rng);
  }
  return out;
}

double rel_l2(const std::vector<float>& got, const std::vector<float>& ref) {
  return compare_values(got.data(), ref.data(), static_cast<int64_t>(std::min(got.size(), ref.size()))).rel_l2;
}

void check(const std::string& label, const std::vector<float>& got, const std::vector<float>& ref,
           const std::vector<float>& moved, const std::vector<float>& moved2, double floor) {
  ASSERT_EQ(got.size(), ref.size()) << label;
  const CompareResult r = compare_values(got.data(), ref.data(), static_cast<int64_t>(got.size()));
  const double sensitivity = std::max(rel_l2(moved, ref), rel_l2(moved2, ref));
  const double bound = std::min(kMaxBound, std::max(floor, kWholeModelFactor * sensitivity));
  std::printf("    %-58s rel_l2 %.3e (sensitivity %.2e, bound %.2e)%s\n", label.c_str(), r.rel_l2, sensitivity, bound,
              r.all_finite ? "" : " NOT FINITE");
  EXPECT_TRUE(r.all_finite) << label;
  EXPECT_LE(r.rel_l2, bound) << label;
}

struct CpuRun {
  TextModelOutput out;
  ParamMap grads;
  std::vector<DecoderLayerSaved> saved;
};

// The CPU reference with only `trained` forming gradients (the adapters; the base frozen, as in the
// engines: a stack trained whole and adapted at once is refused by the reference).
CpuRun run_cpu(const TextConfig& config, const ParamMap& params, const TextBatch& batch, const TextModelInputs& inputs,
               const std::vector<std::string>& trained) {
  CpuRun run;
  TextModel cpu(config, "model", &params);
  run.out = cpu.forward(batch, inputs);
  for (const std::string& name : trained) {
    ParamTensor zero = params.at(name);
    std::fill(zero.values.begin(), zero.values.end(), 0.0f);
    run.grads.emplace(name, std::move(zero));
  }
  cpu.backward_into(&run.grads, 1.0f, 0.0f);
  run.saved = cpu.saved_layers();
  return run;
}

void run_lora_case(const std::vector<int32_t>& cu_seqlens, int64_t rank, bool experts,
                   const std::vector<std::string>& targets = kTargets) {
  const ModelConfig model_config = model_config_preset("tiny");
  const TextConfig& config = model_config.text;
  const int64_t T = cu_seqlens.back();
  std::printf("LoRA rank %lld on %zu target names%s, %lld tokens\n", static_cast<long long>(rank), targets.size(),
              experts ? " + routed experts" : "", static_cast<long long>(T));

  // Base weights and adapters, all rounded to bf16 (the GPU's working copies).
  ParamMap params = random_text_params(config, "model", 7, kMatrixStd);
  for (auto& [name, tensor] : params) {
    if (ends_with(name, "A_log") || ends_with(name, "dt_bias")) continue;
    for (float& v : tensor.values) v = round_to_bf16(v);
  }
  LoraOptions options;
  options.rank = rank;
  options.alpha = 2.0 * static_cast<double>(rank);
  options.target_modules = targets;
  if (experts) options.target_parameters = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  LoraAdapters lora = init_lora_adapters(model_config, options, 11);
  std::mt19937 rng(23);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (const LoraTarget& target : lora.targets) {
    HostTensor& a = lora.tensors.at(target.a_name());
    HostTensor& b = lora.tensors.at(target.b_name());
    for (int64_t i = 0; i < a.numel(); ++i) a.as<float>()[i] = round_to_bf16(a.as<float>()[i]);
    for (int64_t i = 0; i < b.numel(); ++i) b.as<float>()[i] = round_to_bf16(normal(rng));
  }
  attach_lora_adapters(lora, &params, nullptr);
  const ParamMap moved_params = perturbed(params, 12345), moved_params2 = perturbed(params, 67890);

  // Device: the base frozen (bf16 weight, fp32 copies of what is read in fp32), adapters trained.
  const std::set<std::string> read_in_f32 = text_params_read_in_f32(config, "model");
  std::vector<DeviceParamSpec> specs;
  std::vector<std::string> base_names;
  for (const ParamSpec& p : text_param_table(config, "model", true)) {
    specs.push_back({p.name, p.shape.to_vector(), false, read_in_f32.count(p.name) != 0, p.init, 0.02});
    base_names.push_back(p.name);
  }
  for (const LoraTarget& target : lora.targets) {
    specs.push_back({target.a_name(), target.a_shape(rank), true, false, InitKind::zeros, 0});
    specs.push_back({target.b_name(), target.b_shape(rank), true, false, InitKind::zeros, 0});
  }
  DeviceParams device(specs);
  for (const DeviceParamSpec& spec : specs) {
    const ParamTensor& values = params.at(spec.name);
    device.upload(spec.name, 0, static_cast<int64_t>(values.values.size()), values.values.data(), DType::f32);
  }
  ASSERT_EQ(device.trained_layout().entries().size(), 2 * lora.targets.size()) << "only adapters are trained";
  const float scaling = static_cast<float>(options.scaling());
  auto lora_lookup = [&](const std::string& module) {
    DeviceLoraViews views;
    for (const LoraTarget& target : lora.targets) {
      if (target.module != module) continue;
      const DeviceParam a = device.param(target.a_name(), false), b = device.param(target.b_name(), false);
      views = DeviceLoraViews{a.w, b.w, a.grad, b.grad, rank, scaling};
    }
    return views;
  };
  std::vector<std::vector<float>> base_before;
  for (const std::string& name : base_names) base_before.push_back(device.read_values(name));

  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  GpuModelOptions model_options;
  model_options.lora_rank = rank;
  model_options.max_tokens = T + 5;
  model_options.max_seqs = static_cast<int64_t>(cu_seqlens.size());
  model_options.loss_chunk_rows = 16;
  auto gpu = std::make_unique<GpuTextModel>(
      config, bind_text_weights(config, "model", device.lookup(), lora_lookup), model_options, stream);
  std::vector<int64_t> ids(static_cast<size_t>(T)), labels(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) ids[t] = (t * 7919 + 13) % config.vocab_size;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s)
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) labels[t] = t + 1 < cu_seqlens[s + 1] ? ids[t + 1] : -100;
  gpu->set_batch(ids, labels, cu_seqlens);
  gpu->forward_backward();
  const float gpu_loss = gpu->read_loss();
  std::vector<std::vector<int32_t>> routing;
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) routing.push_back(gpu->read_topk_idx(i));
  CUDA_CHECK(cudaStreamSynchronize(stream));

  const TextBatch batch = make_text_batch(config, T, cu_seqlens);
  TextModelInputs inputs;
  inputs.input_ids = ids.data();
  inputs.shifted_labels = labels.data();
  inputs.forced_routing = &routing;
  std::vector<std::string> adapter_names;
  for (const LoraTarget& target : lora.targets) {
    adapter_names.push_back(target.a_name());
    adapter_names.push_back(target.b_name());
  }
  const CpuRun ref = run_cpu(config, params, batch, inputs, adapter_names);
  const CpuRun moved = run_cpu(config, moved_params, batch, inputs, adapter_names);
  const CpuRun moved2 = run_cpu(config, moved_params2, batch, inputs, adapter_names);

  const double loss_rel = std::fabs(gpu_loss - ref.out.ce_loss) / std::max(std::fabs(ref.out.ce_loss), 1e-12);
  std::printf("  ce loss gpu %.6f cpu %.6f rel %.3e\n", gpu_loss, ref.out.ce_loss, loss_rel);
  EXPECT_TRUE(std::isfinite(gpu_loss));
  EXPECT_LE(loss_rel, kLossRel);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    const DecoderLayerSaved& r = ref.saved[static_cast<size_t>(i)];
    check("layer " + std::to_string(i) + " after mixer (h)", gpu->read_layer_activation(i, LayerActivation::after_mixer),
          r.h, moved.saved[static_cast<size_t>(i)].h, moved2.saved[static_cast<size_t>(i)].h, kActivationFloor);
  }
  for (const LoraTarget& target : lora.targets) {
    for (const std::string& name : {target.a_name(), target.b_name()}) {
      ASSERT_TRUE(ref.grads.count(name)) << "the CPU reference forms no gradient for " << name;
      check(name, device.read_gradient(name), ref.grads.at(name).values, moved.grads.at(name).values,
            moved2.grads.at(name).values, kGradFloor);
    }
  }
  for (size_t k = 0; k < base_names.size(); ++k) {
    EXPECT_TRUE(device.read_values(base_names[k]) == base_before[k]) << base_names[k] << " changed";
  }
  gpu.reset();
  CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(GpuTextModelLora, AdaptersMatchCpuReference) { run_lora_case({0, 1, 40, 150}, 8, false); }
TEST(GpuTextModelLora, ExpertAdaptersMatchCpuReference) { run_lora_case({0, 1, 40, 150}, 8, true); }
TEST(GpuTextModelLora, RankFourWithExpertsMatchesCpuReference) { run_lora_case({0, 64, 128}, 4, true); }

// Every Linear of the text model (all-linear on a text model) plus the routed experts: the shared
// expert's three projections and its gate go through the shared expert kernel's adapter hooks.
std::vector<std::string> all_text_linears() {
  std::vector<std::string> targets = kTargets;
  targets.insert(targets.end(), kSharedExpertTargets.begin(), kSharedExpertTargets.end());
  return targets;
}

TEST(GpuTextModelLora, SharedExpertAdaptersMatchCpuReference) {
  run_lora_case({0, 1, 40, 150}, 8, false, kSharedExpertTargets);
}
TEST(GpuTextModelLora, AllTextLinearsWithExpertsMatchCpuReference) {
  run_lora_case({0, 64, 128}, 4, true, all_text_linears());
}

// The router (mlp.gate) is not an nn.Linear in transformers: an adapter there has no GPU path and is
// refused by name at binding.
TEST(GpuTextModelLora, AdapterOnTheRouterIsRefused) {
  const TextConfig config = model_config_preset("tiny").text;
  auto lookup = [](const std::string&, bool) { return DeviceParam{}; };
  auto lora = [](const std::string& module) {
    DeviceLoraViews views;
    if (ends_with(module, "layers.0.mlp.gate")) views.rank = 8;
    return views;
  };
  try {
    bind_text_weights(config, "model", lookup, lora);
    ADD_FAILURE() << "an adapter on the router was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("mlp.gate"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace deltamoe
