// GpuVisionModel against the CPU reference vision tower (fp32) on the same bf16-rounded weights and
// pixels: merged features and every parameter gradient, on the tiny-vl tower and at the real
// Qwen3.5 vision widths (2 blocks, small images); the freezing cases (frozen ViT, frozen merger,
// both); bad image input; and the timing of the full 27-block tower at 8 images of 448x448.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "core/dtype.h"
#include "kernels/common/tensor_compare.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/vision_grid/vision_grid.h"
#include "model/vision/vision_tower.h"
#include "model/vision/gpu/gpu_vision_model.h"
#include "model/gpu/device_params.h"
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
  TowerUnderTest(const VisionConfig& config, const TrainableParts& trainable, int64_t max_patches, int64_t max_images) {
    const std::set<std::string> read_in_f32 = vision_params_read_in_f32(config, kVisionPrefix);
    const std::string merger_prefix = std::string(kVisionPrefix) + ".merger.";
    std::vector<DeviceParamSpec> specs;
    for (const ParamSpec& p : vision_param_table(config, kVisionPrefix)) {
      const bool trained = starts_with(p.name, merger_prefix) ? trainable.aligner : trainable.vit;
      specs.push_back({p.name, p.shape.to_vector(), trained, read_in_f32.count(p.name) != 0, p.init, 0.02});
    }
    params = std::make_unique<DeviceParams>(specs);
    model = std::make_unique<GpuVisionModel>(config, bind_vision_weights(config, kVisionPrefix, params->lookup()),
                                             max_patches, max_images, nullptr);
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

// Timing of the full tower (27 blocks, 8 images of 448x448 = 6,272 patches; random weights filled
// on the device): forward and backward with CUDA events, median of 5 after a warm-up.
TEST(GpuVisionModel, TimingFullTowerEightImagesOf448) {
  const VisionConfig config = model_config_preset("qwen3.5-35b-a3b").vision;
  const std::vector<std::array<int64_t, 3>> grids(8, {1, 28, 28});
  const int64_t N = 8 * 28 * 28, m = config.spatial_merge_size, M = N / (m * m);
  const int64_t C = config.hidden_size, I = config.intermediate_size, K = config.patch_dim();
  const int64_t wide = config.merged_dim(), O = config.out_hidden_size;
  TowerUnderTest tower(config, TrainableParts{true, true, true}, N, 8);
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

  // Dense products + attention (4 S D per query per head over each 784-patch image).
  const double block_linear = 2.0 * N * C * (3.0 * C + C + 2.0 * I);
  const double block_attention = 4.0 * 8 * 784.0 * 784.0 * C;
  const double fwd_flops = config.depth * (block_linear + block_attention) + 2.0 * N * K * C +
                           2.0 * M * wide * (wide + O);
  // Backward: two products per linear (the patch embedding only its weight), 2.5x attention.
  const double bwd_flops = config.depth * (2 * block_linear + 2.5 * block_attention) + 2.0 * N * K * C +
                           2 * 2.0 * M * wide * (wide + O);
  constexpr double kPeakTflops = 989.0;  // H200 dense bf16
  std::printf("  TIMING vision tower fwd  %9.3f ms  %7.1f TFLOP/s  (floor at %.0f TFLOP/s: %.3f ms)\n", fwd,
              fwd_flops / fwd / 1e9, kPeakTflops, fwd_flops / kPeakTflops / 1e9);
  std::printf("  TIMING vision tower bwd  %9.3f ms  %7.1f TFLOP/s  (floor at %.0f TFLOP/s: %.3f ms)\n", bwd,
              bwd_flops / bwd / 1e9, kPeakTflops, bwd_flops / kPeakTflops / 1e9);
  std::printf("  activations + workspace + inputs planned: %.2f GiB\n",
              static_cast<double>(model.bytes().total()) / (1 << 30));
}

}  // namespace
}  // namespace deltamoe
