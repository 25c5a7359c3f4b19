// GpuVisionModel against the CPU reference vision tower (fp32) on the same bf16-rounded weights and
// pixels: merged features and every parameter gradient, on the tiny-vl tower and at the real
// Qwen3.5 vision widths (2 blocks, small images); the freezing cases (frozen ViT, frozen merger,
// both); LoRA adapters on every Linear of the tower (all-linear) with the base frozen, and on the
// merger only; block recompute bitwise equal to keeping every block's activations (with and without
// adapters); bad image input; and the timing of the full 27-block tower (8 images of 448x448, and a
// mixed batch).
#include <cuda_profiler_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "core/dtype.h"
#include "kernels/common/kernel_path_cuda.h"
#include "kernels/common/tensor_compare.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/vision_grid/vision_grid.h"
#include "model/vision/vision_tower.h"
#include "model/vision/gpu/gpu_vision_model.h"
#include "model/gpu/device_params.h"
#include "model/lora/lora_adapters.h"
#include "model/param_table.h"
#include "model/text/text_params.h"
#include "model/vision/vision_weights.h"

namespace deltamoe {
namespace {

// bf16 activations through a few blocks with LayerNorms: each op adds ~2e-3 relative, the
// products accumulate in fp32, so 2e-2 leaves room for ~10 roundings in a row (the brief's bound).
constexpr double kFeatureRel = 2e-2;
constexpr double kGradRel = 2e-2;

bool starts_with(const std::string& text, const std::string& prefix) { return text.rfind(prefix, 0) == 0; }
bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Random bf16-representable tower weights: matrices normal(0, std), biases normal(0, 0.05), norm
// weights 1 + normal(0, 0.1) (LayerNorm scale near one, as trained towers have).
ParamMap random_vision_params(const VisionConfig& config, float matrix_std, uint64_t seed) {
  ParamMap params;
  for (const auto& [name, shape] : vision_param_shapes(config)) {
    const bool is_norm_weight = ends_with(name, "norm.weight") || ends_with(name, "norm1.weight") ||
                                ends_with(name, "norm2.weight");
    const bool is_matrix = shape.rank() >= 2;
    const float scale = is_matrix ? matrix_std : is_norm_weight ? 0.1f : 0.05f;
    HostTensor values = random_normal_tensor(shape, seed++, scale);
    ParamTensor& tensor = params[name];
    tensor.shape = shape.to_vector();
    tensor.values.resize(static_cast<size_t>(values.numel()));
    for (int64_t i = 0; i < values.numel(); ++i)
      tensor.values[static_cast<size_t>(i)] = round_to_bf16((is_norm_weight ? 1.0f : 0.0f) + values.as<float>()[i]);
  }
  return params;
}

VisionParams to_vision_params(const ParamMap& params) {
  VisionParams out;
  for (const auto& [name, tensor] : params) out[name] = HostTensor::from_f32(tensor.values, Shape(tensor.shape));
  return out;
}

HostTensor rounded_random(Shape shape, uint64_t seed, float scale) {
  HostTensor t = random_normal_tensor(shape, seed, scale);
  for (int64_t i = 0; i < t.numel(); ++i) t.as<float>()[i] = round_to_bf16(t.as<float>()[i]);
  return t;
}

std::vector<float> download_bf16(const DeviceTensor& t) {
  HostTensor host = to_host(t.view).to_f32();
  return std::vector<float>(host.as<float>(), host.as<float>() + host.numel());
}

// A tower on the GPU: its parameters in DeviceParams (the parts `trainable` names get master and
// gradients, the others bf16 weights and their fp32 copies), the model bound to them.
struct TowerUnderTest {
  std::unique_ptr<DeviceParams> params;
  std::unique_ptr<GpuVisionModel> model;
  TowerUnderTest(const VisionConfig& config, const TrainableParts& trainable, int64_t max_patches, int64_t max_images,
                 int64_t recompute_blocks = 0) {
    const std::set<std::string> read_in_f32 = vision_params_read_in_f32(config, kVisionPrefix);
    const std::string merger_prefix = std::string(kVisionPrefix) + ".merger.";
    std::vector<DeviceParamSpec> specs;
    for (const ParamSpec& p : vision_param_table(config, kVisionPrefix)) {
      const bool trained = starts_with(p.name, merger_prefix) ? trainable.aligner : trainable.vit;
      specs.push_back({p.name, p.shape.to_vector(), trained, read_in_f32.count(p.name) != 0, p.init, 0.02});
    }
    params = std::make_unique<DeviceParams>(specs);
    model = std::make_unique<GpuVisionModel>(config, bind_vision_weights(config, kVisionPrefix, params->lookup()),
                                             max_patches, max_images, nullptr, recompute_blocks);
  }
  void upload(const ParamMap& values) {
    for (const auto& [name, tensor] : values)
      params->upload(name, 0, static_cast<int64_t>(tensor.values.size()), tensor.values.data(), DType::f32);
  }
};

struct TowerCase {
  const char* label;
  VisionConfig config;
  std::vector<std::array<int64_t, 3>> grids;
  float matrix_std;
};

// Runs the GPU tower and the CPU reference on the same inputs for each freezing choice and checks
// features and gradients; returns nothing, fails through EXPECT.
void check_tower(const TowerCase& c) {
  const VisionConfig& config = c.config;
  const int64_t m = config.spatial_merge_size, O = config.out_hidden_size;
  std::vector<int64_t> grid_values;
  for (const auto& g : c.grids) grid_values.insert(grid_values.end(), g.begin(), g.end());
  const int64_t num_images = static_cast<int64_t>(c.grids.size());
  const int64_t N = vision_num_patches(grid_values.data(), num_images), M = N / (m * m);
  std::printf("%s: %lld images, N=%lld patches, M=%lld merged, C=%lld, depth %lld\n", c.label,
              static_cast<long long>(num_images), static_cast<long long>(N), static_cast<long long>(M),
              static_cast<long long>(config.hidden_size), static_cast<long long>(config.depth));
  const ParamMap params = random_vision_params(config, c.matrix_std, 100);
  const VisionParams cpu_params = to_vision_params(params);
  const HostTensor pixels = rounded_random(Shape{N, config.patch_dim()}, 7, 1.0f);
  HostTensor grid_thw(DType::i64, Shape{num_images, 3});
  std::copy(grid_values.begin(), grid_values.end(), grid_thw.as<int64_t>());
  const HostTensor d_features = rounded_random(Shape{M, O}, 8, 1.0f);

  const VisionTowerOutput cpu = vision_tower_forward(cpu_params, config, pixels, grid_thw);

  const DeviceTensor d_merged = to_device(d_features, DType::bf16);
  const std::string merger_prefix = std::string(kVisionPrefix) + ".merger.";
  size_t all_trained_bytes = 0;
  for (const TrainableParts trainable : {TrainableParts{true, true, true}, TrainableParts{false, true, true},
                                         TrainableParts{true, false, true}, TrainableParts{false, false, true}}) {
    // Planned larger than used, so a slice mistake would read the wrong rows.
    TowerUnderTest tower(config, trainable, N + 4 * m * m, num_images + 1);
    tower.upload(params);
    GpuVisionModel& model = *tower.model;
    // cuDNN's fused attention on the sm_90a path unless DELTAMOE_ATTENTION=ours (cudnn_attention_choice.h).
    const bool cudnn_expected = sm90a_kernels_usable() && std::getenv("DELTAMOE_ATTENTION") == nullptr;
    std::printf("  attention: %s\n", model.attention_backend());
    EXPECT_STREQ(model.attention_backend(), cudnn_expected ? "cudnn" : "ours");
    model.set_images(pixels.as<float>(), N, c.grids);
    ASSERT_EQ(model.num_merged(), M);
    DeviceTensor merged = device_tensor(DType::bf16, Shape{M, O});
    device_fill_bytes(merged.view, 0xFF);  // NaN: an unwritten row cannot pass
    model.forward(bf16_ptr(merged));
    device_synchronize();
    const std::vector<float> got_features = download_bf16(merged);
    const CompareResult features =
        compare_values(got_features.data(), cpu.features.as<float>(), static_cast<int64_t>(got_features.size()));
    std::printf("  vit=%d merger=%d: features max|diff| %.3e  max|ref| %.3e  rel_l2 %.3e%s; model holds %.1f MiB\n",
                trainable.vit, trainable.aligner, features.max_abs_diff, features.max_abs_ref, features.rel_l2,
                features.all_finite ? "" : "  NOT FINITE", model.bytes().total() / 1048576.0);
    EXPECT_TRUE(features.all_finite) << c.label;
    EXPECT_LE(features.rel_l2, kFeatureRel) << c.label << " features";
    // A frozen ViT keeps nothing for a backward: the model is smaller than a trained one.
    if (trainable.vit && trainable.aligner) all_trained_bytes = model.bytes().total();
    if (!trainable.vit && config.depth > 1) {
      EXPECT_LT(model.bytes().activations, all_trained_bytes);
    }

    VisionParams cpu_grads;
    if (trainable.vision())
      vision_tower_backward(cpu_params, config, cpu.saved, d_features, &cpu_grads, kVisionPrefix, trainable);
    model.backward(bf16_ptr(d_merged));
    device_synchronize();
    double worst = 0;
    std::string worst_name = "(none)";
    int compared = 0, frozen = 0;
    for (const auto& [name, shape] : vision_param_shapes(config)) {
      const auto ref = cpu_grads.find(name);
      const bool trained = starts_with(name, merger_prefix) ? trainable.aligner : trainable.vit;
      if (!trained) {
        // Frozen: the reference has no entry and the GPU holds no gradient for it.
        EXPECT_TRUE(ref == cpu_grads.end()) << name;
        EXPECT_EQ(tower.params->param(name, false).grad, nullptr) << name;
        ++frozen;
        continue;
      }
      ASSERT_TRUE(ref != cpu_grads.end()) << name;
      const std::vector<float> got = tower.params->read_gradient(name);
      const CompareResult r = compare_values(got.data(), ref->second.as<float>(), shape.numel());
      EXPECT_TRUE(r.all_finite) << c.label << " " << name;
      EXPECT_LE(r.rel_l2, kGradRel) << c.label << " " << name << " max|diff| " << r.max_abs_diff << " max|ref| "
                                    << r.max_abs_ref;
      const double score = r.all_finite ? r.rel_l2 : INFINITY;
      if (score > worst) {
        worst = score;
        worst_name = name;
      }
      ++compared;
    }
    std::printf("  backward vit=%d merger=%d: %d gradients compared, worst rel_l2 %.3e (%s); %d frozen without one\n",
                trainable.vit, trainable.aligner, compared, worst, worst_name.c_str(), frozen);
  }
}

TEST(GpuVisionModel, MatchesCpuTowerOnTinyVl) {
  TowerCase c{"tiny-vl", model_config_preset("tiny-vl").vision, {{1, 4, 6}, {1, 6, 2}, {2, 2, 4}}, 0.1f};
  check_tower(c);
}

TEST(GpuVisionModel, MatchesCpuTowerAtQwen35Widths) {
  // Real widths (C 1152, 16 heads x 72, MLP 4304, merger 4608 -> 2048, 48x48 position grid) with 2
  // blocks so the fp32 CPU reference stays quick; images of 8x8 and 4x12 patches.
  VisionConfig config = model_config_preset("qwen3.5-35b-a3b").vision;
  config.depth = 2;
  TowerCase c{"qwen3.5 widths, 2 blocks", config, {{1, 8, 8}, {1, 4, 12}}, 0.02f};
  check_tower(c);
}

// The same through our flash-attention kernel (the fallback and the sm_80 path).
TEST(GpuVisionModel, MatchesCpuTowerAtQwen35WidthsWithOurAttention) {
  VisionConfig config = model_config_preset("qwen3.5-35b-a3b").vision;
  config.depth = 2;
  setenv("DELTAMOE_ATTENTION", "ours", 1);
  TowerCase c{"qwen3.5 widths, 2 blocks, our attention", config, {{1, 8, 8}, {1, 4, 12}}, 0.02f};
  check_tower(c);
  unsetenv("DELTAMOE_ATTENTION");
}

// An adapter's A gradient passes one more bf16 rounding than a base weight's (dy B is rounded to
// bf16 before dA = (dy B)^T x), so its bound is 1.5 x the tower's.
constexpr double kAdapterGradRel = 3e-2;

// LoRA on the tower: the base frozen (bf16 weights, fp32 copies of what is read in fp32, no
// gradients), the adapters of `targets` (module suffixes as --target_modules; all-linear resolved on
// tiny-vl, its vision part kept) trained, B random so every adapter product matters. Features and
// every adapter gradient against the CPU reference with the same adapters attached
// (vision_projection.h); the base weights bitwise unchanged; the activations kept for a backward
// follow what the adapters need (the blocks' only when a block carries one).
void check_tower_lora(const std::vector<std::string>& target_modules, int64_t rank) {
  const ModelConfig model_config = model_config_preset("tiny-vl");
  const VisionConfig& config = model_config.vision;
  const std::vector<std::array<int64_t, 3>> grids = {{1, 4, 6}, {1, 6, 2}, {2, 2, 4}};
  std::vector<int64_t> grid_values;
  for (const auto& g : grids) grid_values.insert(grid_values.end(), g.begin(), g.end());
  const int64_t num_images = static_cast<int64_t>(grids.size()), m = config.spatial_merge_size;
  const int64_t N = vision_num_patches(grid_values.data(), num_images), M = N / (m * m), O = config.out_hidden_size;

  LoraOptions options;
  options.rank = rank;
  options.alpha = 2.0 * static_cast<double>(rank);
  options.target_modules = target_modules;
  LoraAdapters lora = init_lora_adapters(model_config, options, 5);
  std::vector<LoraTarget> vision_targets;
  for (const LoraTarget& t : lora.targets)
    if (t.module.starts_with("model.visual.")) vision_targets.push_back(t);
  lora.targets = vision_targets;
  ASSERT_FALSE(lora.targets.empty());
  bool blocks_adapted = false;
  std::mt19937 rng(31);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (const LoraTarget& t : lora.targets) {
    blocks_adapted = blocks_adapted || !t.module.starts_with(std::string(kVisionPrefix) + ".merger.");
    HostTensor& a = lora.tensors.at(t.a_name());
    HostTensor& b = lora.tensors.at(t.b_name());
    for (int64_t i = 0; i < a.numel(); ++i) a.as<float>()[i] = round_to_bf16(a.as<float>()[i]);
    for (int64_t i = 0; i < b.numel(); ++i) b.as<float>()[i] = round_to_bf16(normal(rng));
  }
  std::printf("tiny-vl tower, LoRA r %lld on %zu Linears (%s), N=%lld patches\n", static_cast<long long>(rank),
              lora.targets.size(), blocks_adapted ? "blocks and merger" : "merger only", static_cast<long long>(N));

  const ParamMap params = random_vision_params(config, 0.1f, 100);
  VisionParams cpu_params = to_vision_params(params);
  attach_lora_adapters(lora, nullptr, &cpu_params);
  const HostTensor pixels = rounded_random(Shape{N, config.patch_dim()}, 7, 1.0f);
  HostTensor grid_thw(DType::i64, Shape{num_images, 3});
  std::copy(grid_values.begin(), grid_values.end(), grid_thw.as<int64_t>());
  const HostTensor d_features = rounded_random(Shape{M, O}, 8, 1.0f);
  const VisionTowerOutput cpu = vision_tower_forward(cpu_params, config, pixels, grid_thw);
  VisionParams cpu_grads;
  for (const LoraTarget& t : lora.targets)
    for (const std::string& name : {t.a_name(), t.b_name()})
      cpu_grads.emplace(name, HostTensor(DType::f32, lora.tensors.at(name).shape()));
  for (auto& [name, tensor] : cpu_grads) std::fill(tensor.as<float>(), tensor.as<float>() + tensor.numel(), 0.0f);
  vision_tower_backward(cpu_params, config, cpu.saved, d_features, &cpu_grads, kVisionPrefix,
                        TrainableParts{true, true, false, /*base_weights=*/false});

  const std::set<std::string> read_in_f32 = vision_params_read_in_f32(config, kVisionPrefix);
  std::vector<DeviceParamSpec> specs;
  std::vector<std::string> base_names;
  for (const ParamSpec& p : vision_param_table(config, kVisionPrefix)) {
    specs.push_back({p.name, p.shape.to_vector(), false, read_in_f32.count(p.name) != 0, p.init, 0.02});
    base_names.push_back(p.name);
  }
  for (const LoraTarget& t : lora.targets) {
    specs.push_back({t.a_name(), t.a_shape(rank), true, false, InitKind::zeros, 0});
    specs.push_back({t.b_name(), t.b_shape(rank), true, false, InitKind::zeros, 0});
  }
  DeviceParams device(specs);
  for (const auto& [name, tensor] : params)
    device.upload(name, 0, static_cast<int64_t>(tensor.values.size()), tensor.values.data(), DType::f32);
  for (const LoraTarget& t : lora.targets)
    for (const std::string& name : {t.a_name(), t.b_name()})
      device.upload(name, 0, lora.tensors.at(name).numel(), lora.tensors.at(name).as<float>(), DType::f32);
  const float scaling = static_cast<float>(options.scaling());
  auto lora_lookup = [&](const std::string& module) {
    DeviceLoraViews views;
    for (const LoraTarget& t : lora.targets) {
      if (t.module != module) continue;
      const DeviceParam a = device.param(t.a_name(), false), b = device.param(t.b_name(), false);
      views = DeviceLoraViews{a.w, b.w, a.grad, b.grad, rank, scaling};
    }
    return views;
  };
  std::vector<std::vector<float>> base_before;
  for (const std::string& name : base_names) base_before.push_back(device.read_values(name));
  const VisionWeights weights = bind_vision_weights(config, kVisionPrefix, device.lookup(), lora_lookup);
  EXPECT_EQ(weights.vit_trained(), blocks_adapted) << "adapters in the blocks make the blocks run a backward";
  EXPECT_TRUE(weights.merger_trained() || blocks_adapted);
  EXPECT_EQ(weights.lora_rank(), rank);
  GpuVisionModel model(config, weights, N + 4 * m * m, num_images + 1, nullptr);
  const GpuVisionBytes frozen_bytes = GpuVisionModel::planned_bytes(config, N + 4 * m * m, num_images + 1, false, false);
  if (blocks_adapted) {
    EXPECT_GT(model.bytes().activations, frozen_bytes.activations);
  }
  model.set_images(pixels.as<float>(), N, grids);
  DeviceTensor merged = device_tensor(DType::bf16, Shape{M, O});
  device_fill_bytes(merged.view, 0xFF);
  model.forward(bf16_ptr(merged));
  device_synchronize();
  const std::vector<float> got_features = download_bf16(merged);
  const CompareResult features =
      compare_values(got_features.data(), cpu.features.as<float>(), static_cast<int64_t>(got_features.size()));
  std::printf("  features rel_l2 %.3e%s\n", features.rel_l2, features.all_finite ? "" : " NOT FINITE");
  EXPECT_TRUE(features.all_finite);
  EXPECT_LE(features.rel_l2, kFeatureRel);
  const DeviceTensor d_merged = to_device(d_features, DType::bf16);
  model.backward(bf16_ptr(d_merged));
  device_synchronize();
  double worst = 0;
  std::string worst_name = "(none)";
  for (const LoraTarget& t : lora.targets) {
    for (const std::string& name : {t.a_name(), t.b_name()}) {
      const std::vector<float> got = device.read_gradient(name);
      const HostTensor& ref = cpu_grads.at(name);
      const CompareResult r = compare_values(got.data(), ref.as<float>(), ref.numel());
      EXPECT_TRUE(r.all_finite) << name;
      EXPECT_GT(r.max_abs_ref, 0.0) << name << ": the reference gradient is zero (the case tests nothing)";
      EXPECT_LE(r.rel_l2, kAdapterGradRel) << name << " max|diff| " << r.max_abs_diff << " max|ref| " << r.max_abs_ref;
      if (!(r.rel_l2 <= worst)) {
        worst = r.rel_l2;
        worst_name = name;
      }
    }
  }
  std::printf("  %zu adapter gradients compared, worst rel_l2 %.3e (%s)\n", 2 * lora.targets.size(), worst,
              worst_name.c_str());
  for (size_t k = 0; k < base_names.size(); ++k) {
    EXPECT_TRUE(device.read_values(base_names[k]) == base_before[k]) << base_names[k] << " changed";
    EXPECT_EQ(device.param(base_names[k], false).grad, nullptr) << base_names[k] << " holds a gradient";
  }
}

TEST(GpuVisionModel, LoraOnEveryLinearMatchesCpuTower) { check_tower_lora({"all-linear"}, 8); }
TEST(GpuVisionModel, LoraOnTheMergerOnlyMatchesCpuTower) {
  check_tower_lora({"merger.linear_fc1", "merger.linear_fc2"}, 4);
}

// What one training run of the tower produced: the features of each forward and every trained
// tensor's gradient after the last backward (gradients accumulate over the steps).
struct TowerRun {
  std::vector<std::vector<float>> features;
  std::vector<std::pair<std::string, std::vector<float>>> grads;
  GpuVisionBytes bytes;
};

// Two forward+backward steps of a 4-block tiny-vl tower with its first recompute_blocks blocks
// recomputed: the base trained, or (lora) frozen with rank-4 adapters on every Linear of the tower,
// B random so each adapter product matters in the rerun.
TowerRun run_recomputed_tower(int64_t recompute_blocks, bool lora) {
  ModelConfig model_config = model_config_preset("tiny-vl");
  model_config.vision.depth = 4;
  const VisionConfig& config = model_config.vision;
  const std::vector<std::array<int64_t, 3>> grids = {{1, 4, 6}, {1, 6, 2}, {2, 2, 4}};
  std::vector<int64_t> grid_values;
  for (const auto& g : grids) grid_values.insert(grid_values.end(), g.begin(), g.end());
  const int64_t num_images = static_cast<int64_t>(grids.size()), m = config.spatial_merge_size;
  const int64_t N = vision_num_patches(grid_values.data(), num_images), M = N / (m * m), O = config.out_hidden_size;
  const int64_t rank = 4;

  LoraAdapters adapters;
  if (lora) {
    LoraOptions options;
    options.rank = rank;
    options.alpha = 8.0;
    options.target_modules = {"all-linear"};
    adapters = init_lora_adapters(model_config, options, 5);
    std::vector<LoraTarget> vision_targets;
    for (const LoraTarget& t : adapters.targets)
      if (t.module.starts_with("model.visual.")) vision_targets.push_back(t);
    adapters.targets = vision_targets;
    std::mt19937 rng(31);
    std::normal_distribution<float> normal(0.0f, 0.05f);
    for (const LoraTarget& t : adapters.targets) {
      HostTensor& b = adapters.tensors.at(t.b_name());
      for (int64_t i = 0; i < b.numel(); ++i) b.as<float>()[i] = normal(rng);
    }
  }
  const std::set<std::string> read_in_f32 = vision_params_read_in_f32(config, kVisionPrefix);
  std::vector<DeviceParamSpec> specs;
  std::vector<std::string> trained;
  for (const ParamSpec& p : vision_param_table(config, kVisionPrefix)) {
    specs.push_back({p.name, p.shape.to_vector(), !lora, read_in_f32.count(p.name) != 0, p.init, 0.02});
    if (!lora) trained.push_back(p.name);
  }
  for (const LoraTarget& t : adapters.targets) {
    specs.push_back({t.a_name(), t.a_shape(rank), true, false, InitKind::zeros, 0});
    specs.push_back({t.b_name(), t.b_shape(rank), true, false, InitKind::zeros, 0});
    trained.push_back(t.a_name());
    trained.push_back(t.b_name());
  }
  DeviceParams device(specs);
  for (const auto& [name, tensor] : random_vision_params(config, 0.1f, 100))
    device.upload(name, 0, static_cast<int64_t>(tensor.values.size()), tensor.values.data(), DType::f32);
  for (const LoraTarget& t : adapters.targets)
    for (const std::string& name : {t.a_name(), t.b_name()})
      device.upload(name, 0, adapters.tensors.at(name).numel(), adapters.tensors.at(name).as<float>(), DType::f32);
  auto lora_lookup = [&](const std::string& module) {
    DeviceLoraViews views;
    for (const LoraTarget& t : adapters.targets) {
      if (t.module != module) continue;
      const DeviceParam a = device.param(t.a_name(), false), b = device.param(t.b_name(), false);
      views = DeviceLoraViews{a.w, b.w, a.grad, b.grad, rank, 2.0f};
    }
    return views;
  };
  const VisionWeights weights = bind_vision_weights(config, kVisionPrefix, device.lookup(), lora_lookup);
  EXPECT_TRUE(weights.vit_trained());
  GpuVisionModel model(config, weights, N + 4 * m * m, num_images + 1, nullptr, recompute_blocks);
  TowerRun run;
  run.bytes = model.bytes();
  const HostTensor pixels = rounded_random(Shape{N, config.patch_dim()}, 7, 1.0f);
  model.set_images(pixels.as<float>(), N, grids);
  for (int step = 0; step < 2; ++step) {
    const DeviceTensor d_merged = to_device(rounded_random(Shape{M, O}, 8 + step, 1.0f), DType::bf16);
    DeviceTensor merged = device_tensor(DType::bf16, Shape{M, O});
    device_fill_bytes(merged.view, 0xFF);
    model.forward(bf16_ptr(merged));
    model.backward(bf16_ptr(d_merged));
    device_synchronize();
    run.features.push_back(download_bf16(merged));
  }
  for (const std::string& name : trained) run.grads.emplace_back(name, device.read_gradient(name));
  return run;
}

// Bitwise: the rerun reads the kept fp32 input with the same kernels (our own attention, which is
// deterministic), so features and every gradient equal those of the run that kept everything.
void check_recompute_is_bitwise(bool lora) {
  const int64_t depth = 4;
  setenv("DELTAMOE_ATTENTION", "ours", 1);  // cuDNN's attention backward adds dQ with fp32 atomics
  const TowerRun kept = run_recomputed_tower(0, lora);
  size_t previous_bytes = kept.bytes.activations;
  bool any_nonzero = false;
  for (const auto& [name, grad] : kept.grads)
    any_nonzero = any_nonzero || std::any_of(grad.begin(), grad.end(), [](float v) { return v != 0.0f; });
  EXPECT_TRUE(any_nonzero) << "the reference run has only zero gradients (the case tests nothing)";
  for (const int64_t blocks : {int64_t{1}, depth - 1, depth}) {
    const TowerRun run = run_recomputed_tower(blocks, lora);
    std::printf("  lora=%d recompute_blocks=%lld: activations %.3f MiB (kept: %.3f MiB)\n", lora,
                static_cast<long long>(blocks), run.bytes.activations / 1048576.0, kept.bytes.activations / 1048576.0);
    // One recomputed block holds its input and the shared set, as much as keeping it; each further
    // one saves a block's activations.
    if (blocks == 1) {
      EXPECT_EQ(run.bytes.activations, kept.bytes.activations);
    } else {
      EXPECT_LT(run.bytes.activations, previous_bytes) << blocks << " recomputed blocks";
    }
    previous_bytes = run.bytes.activations;
    ASSERT_EQ(run.features.size(), kept.features.size());
    for (size_t step = 0; step < kept.features.size(); ++step) {
      EXPECT_TRUE(run.features[step] == kept.features[step]) << blocks << " recomputed blocks: features of step "
                                                             << step << " differ";
    }
    ASSERT_EQ(run.grads.size(), kept.grads.size());
    for (size_t k = 0; k < kept.grads.size(); ++k) {
      const std::vector<float>& a = run.grads[k].second;
      const std::vector<float>& b = kept.grads[k].second;
      ASSERT_EQ(a.size(), b.size());
      const bool bitwise = std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
      EXPECT_TRUE(bitwise) << blocks << " recomputed blocks: gradient of " << kept.grads[k].first << " differs";
    }
  }
  unsetenv("DELTAMOE_ATTENTION");
}

TEST(GpuVisionModel, RecomputedBlocksAreBitwiseTheKeptOnes) { check_recompute_is_bitwise(false); }
TEST(GpuVisionModel, RecomputedBlocksWithLoraAreBitwiseTheKeptOnes) { check_recompute_is_bitwise(true); }

TEST(GpuVisionModel, RecomputeIsPlannedAsAllocatedAndRefusedOutOfRange) {
  VisionConfig config = model_config_preset("tiny-vl").vision;
  config.depth = 3;
  for (const int64_t blocks : {0, 1, 3}) {
    TowerUnderTest tower(config, TrainableParts{true, true, true}, 64, 2, blocks);
    const GpuVisionBytes planned = GpuVisionModel::planned_bytes(config, 64, 2, true, true, 0, blocks);
    EXPECT_EQ(tower.model->bytes().total(), planned.total()) << blocks;
  }
  // A frozen ViT keeps nothing for a backward: recompute changes nothing there.
  EXPECT_EQ(GpuVisionModel::planned_bytes(config, 64, 2, false, true, 0, 3).total(),
            GpuVisionModel::planned_bytes(config, 64, 2, false, true, 0, 0).total());
  EXPECT_THROW({ TowerUnderTest tower(config, TrainableParts{true, true, true}, 64, 2, 4); }, Error);
  EXPECT_THROW({ TowerUnderTest tower(config, TrainableParts{true, true, true}, 64, 2, -1); }, Error);
}

TEST(GpuVisionModel, LoraOnThePatchEmbeddingIsRefused) {
  const VisionConfig config = model_config_preset("tiny-vl").vision;
  auto lookup = [](const std::string&, bool) { return DeviceParam{}; };
  auto lora = [](const std::string& module) {
    DeviceLoraViews views;
    if (module.ends_with("patch_embed.proj")) views.rank = 8;
    return views;
  };
  try {
    bind_vision_weights(config, kVisionPrefix, lookup, lora);
    ADD_FAILURE() << "an adapter on the patch embedding (a Conv3d) was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("patch_embed.proj"), std::string::npos) << e.what();
  }
}

TEST(GpuVisionModel, RejectsBadImages) {
  const VisionConfig config = model_config_preset("tiny-vl").vision;
  TowerUnderTest tower(config, TrainableParts{true, true, true}, 64, 2);
  GpuVisionModel& model = *tower.model;
  std::vector<float> pixels(static_cast<size_t>(64 * config.patch_dim()), 0.5f);
  EXPECT_THROW(model.set_images(pixels.data(), 24, {{1, 4, 4}}), Error);           // 16 patches described
  EXPECT_THROW(model.set_images(pixels.data(), 12, {{1, 3, 4}}), Error);           // h not a multiple of 2
  EXPECT_THROW(model.set_images(pixels.data(), 80, {{1, 8, 10}}), Error);          // over max_patches
  EXPECT_THROW(model.set_images(pixels.data(), 12, {{1, 2, 2}, {1, 2, 2}, {1, 2, 2}}), Error);  // over max_images
  EXPECT_THROW(model.forward(nullptr), Error);                                    // before set_images
}

// Timing of the full tower (27 blocks; random weights filled on the device) on the batches
// tools/gpu/vision_anchor.py gives transformers' tower: 8 images of 448x448 (6,272 patches) and a
// mixed batch of 4 (1024x768, 448x448, 640x480, 512x512: 6,080 patches). Forward and backward with
// CUDA events, median of 5 after a warm-up; FLOPs counted as the anchor counts them. With
// DELTAMOE_VISION_PROFILE set it profiles instead (profile_two_blocks).
void time_tower(const char* label, const std::vector<std::array<int64_t, 3>>& grids) {
  const VisionConfig config = model_config_preset("qwen3.5-35b-a3b").vision;
  int64_t N = 0;
  double squares = 0;  // sum over frames of S^2
  for (const auto& g : grids) {
    N += g[0] * g[1] * g[2];
    squares += static_cast<double>(g[0]) * static_cast<double>(g[1] * g[2]) * static_cast<double>(g[1] * g[2]);
  }
  const int64_t m = config.spatial_merge_size, M = N / (m * m);
  const int64_t C = config.hidden_size, I = config.intermediate_size, K = config.patch_dim();
  const int64_t wide = config.merged_dim(), O = config.out_hidden_size;
  TowerUnderTest tower(config, TrainableParts{true, true, true}, N, static_cast<int64_t>(grids.size()));
  tower.params->randomize(3);  // the parameter table's init rules
  GpuVisionModel& model = *tower.model;
  const HostTensor pixels = random_normal_tensor(Shape{N, K}, 11, 1.0f);
  model.set_images(pixels.as<float>(), N, grids);
  DeviceTensor merged = device_tensor(DType::bf16, Shape{M, O});
  const DeviceTensor d_merged = to_device(random_normal_tensor(Shape{M, O}, 12, 1e-2f), DType::bf16);

  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  auto median_ms = [&](auto&& body) {
    body();  // warm-up (cuBLASLt heuristics)
    std::vector<float> times;
    for (int r = 0; r < 5; ++r) {
      CUDA_CHECK(cudaEventRecord(start, nullptr));
      body();
      CUDA_CHECK(cudaEventRecord(stop, nullptr));
      CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      times.push_back(ms);
    }
    std::sort(times.begin(), times.end());
    return static_cast<double>(times[times.size() / 2]);
  };
  const double fwd = median_ms([&] { model.forward(bf16_ptr(merged)); });
  const double bwd = median_ms([&] { model.backward(bf16_ptr(d_merged)); });
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  const std::vector<float> out = download_bf16(merged);
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return std::isfinite(v); }));

  // Dense products + attention (4 S^2 C per frame).
  const double block_linear = 2.0 * N * C * (3.0 * C + C + 2.0 * I);
  const double block_attention = 4.0 * squares * C;
  const double fwd_flops = config.depth * (block_linear + block_attention) + 2.0 * N * K * C +
                           2.0 * M * wide * (wide + O);
  // Backward: two products per linear (the patch embedding only its weight), 2.5x attention.
  const double bwd_flops = config.depth * (2 * block_linear + 2.5 * block_attention) + 2.0 * N * K * C +
                           2 * 2.0 * M * wide * (wide + O);
  constexpr double kPeakTflops = 989.0;  // H200 dense bf16
  std::printf("%s: %lld patches, %zu images, attention %s\n", label, static_cast<long long>(N), grids.size(),
              model.attention_backend());
  std::printf("  TIMING vision tower fwd  %9.3f ms  %7.1f TFLOP/s  (floor at %.0f TFLOP/s: %.3f ms)\n", fwd,
              fwd_flops / fwd / 1e9, kPeakTflops, fwd_flops / kPeakTflops / 1e9);
  std::printf("  TIMING vision tower bwd  %9.3f ms  %7.1f TFLOP/s  (floor at %.0f TFLOP/s: %.3f ms)\n", bwd,
              bwd_flops / bwd / 1e9, kPeakTflops, bwd_flops / kPeakTflops / 1e9);
  std::printf("VISION_OURS {\"batch\": \"%s\", \"patches\": %lld, \"fwd_ms\": %.2f, \"bwd_ms\": %.2f, "
              "\"fwd_bwd_ms\": %.2f, \"fwd_bwd_tflops\": %.1f, \"floor_fwd_bwd_ms\": %.2f}\n",
              label, static_cast<long long>(N), fwd, bwd, fwd + bwd, (fwd_flops + bwd_flops) / (fwd + bwd) / 1e9,
              (fwd_flops + bwd_flops) / kPeakTflops / 1e9);
  std::printf("  activations + workspace + inputs planned: %.2f GiB\n",
              static_cast<double>(model.bytes().total()) / (1 << 30));
}

// One forward + backward of a 2-block tower at the full widths between cudaProfilerStart/Stop, after
// a warm-up: `ncu --profile-from-start off` then times each kernel of a block once.
void profile_two_blocks() {
  VisionConfig config = model_config_preset("qwen3.5-35b-a3b").vision;
  config.depth = 2;
  const std::vector<std::array<int64_t, 3>> grids(8, {1, 28, 28});
  const int64_t N = 8 * 28 * 28, M = N / 4;
  TowerUnderTest tower(config, TrainableParts{true, true, true}, N, 8);
  tower.params->randomize(3);
  const HostTensor pixels = random_normal_tensor(Shape{N, config.patch_dim()}, 11, 1.0f);
  tower.model->set_images(pixels.as<float>(), N, grids);
  DeviceTensor merged = device_tensor(DType::bf16, Shape{M, config.out_hidden_size});
  const DeviceTensor d_merged =
      to_device(random_normal_tensor(Shape{M, config.out_hidden_size}, 12, 1e-2f), DType::bf16);
  for (int pass = 0; pass < 2; ++pass) {
    device_synchronize();
    if (pass == 1) CUDA_CHECK(cudaProfilerStart());
    tower.model->forward(bf16_ptr(merged));
    tower.model->backward(bf16_ptr(d_merged));
    device_synchronize();
  }
  CUDA_CHECK(cudaProfilerStop());
  std::printf("profiled one forward + backward of a 2-block tower (attention: %s)\n",
              tower.model->attention_backend());
}

TEST(GpuVisionModel, TimingFullTower) {
  if (std::getenv("DELTAMOE_VISION_PROFILE") != nullptr) {
    profile_two_blocks();
    return;
  }
  time_tower("8 x 448^2", std::vector<std::array<int64_t, 3>>(8, {1, 28, 28}));
  time_tower("mixed 4 (1024x768, 448^2, 640x480, 512^2)", {{1, 64, 48}, {1, 28, 28}, {1, 40, 30}, {1, 32, 32}});
}

}  // namespace
}  // namespace deltamoe
