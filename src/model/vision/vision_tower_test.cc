// Vision tower reference on a tiny random config: parameter names match the model's parameter
// table, a depth-0 tower equals a direct Conv3d + merger, images do not see each other, fp32 agrees
// with fp64, and every parameter gradient (and d_pixel_values) matches fp64 finite differences.
#include "model/vision/vision_tower.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "kernels/gradcheck/gradcheck.h"
#include "model/config.h"
#include "model/param_table.h"

namespace deltamoe {
namespace {

VisionConfig tiny_config() {
  VisionConfig config;
  config.depth = 2;
  config.hidden_size = 8;
  config.num_heads = 2;  // head dim 4
  config.intermediate_size = 12;
  config.patch_size = 2;
  config.temporal_patch_size = 2;
  config.spatial_merge_size = 2;
  config.out_hidden_size = 5;
  config.num_position_embeddings = 16;  // a 4 x 4 table
  return config;
}

VisionParams random_params(const VisionConfig& config, uint64_t seed, DType dtype) {
  Rng rng(seed);
  VisionParams params;
  for (const auto& [name, shape] : vision_param_shapes(config)) {
    HostTensor tensor(DType::f64, shape);
    const bool is_norm_weight = name.find("norm") != std::string::npos && name.ends_with(".weight");
    const bool is_bias = name.ends_with(".bias");
    for (int64_t i = 0; i < tensor.numel(); ++i) {
      tensor.as<double>()[i] = is_norm_weight ? 1.0 + 0.2 * rng.normal() : (is_bias ? 0.1 : 0.4) * rng.normal();
    }
    params.emplace(name, dtype == DType::f64 ? tensor : tensor.to_dtype(DType::f32));
  }
  return params;
}

HostTensor make_grid(const std::vector<int64_t>& values) {
  HostTensor grid(DType::i64, Shape{static_cast<int64_t>(values.size() / 3), 3});
  std::copy(values.begin(), values.end(), grid.as<int64_t>());
  return grid;
}

HostTensor random_tensor(Rng& rng, Shape shape) {
  HostTensor tensor(DType::f64, shape);
  for (int64_t i = 0; i < tensor.numel(); ++i) tensor.as<double>()[i] = rng.normal();
  return tensor;
}

std::vector<double> to_vector(const HostTensor& tensor) {
  return {tensor.as<double>(), tensor.as<double>() + tensor.numel()};
}

TEST(VisionTower, ParameterNamesMatchTheModelTable) {
  const ModelConfig model = model_config_preset("qwen3.5-35b-a3b");
  std::set<std::string> table_names, tower_names;
  for (const ParamSpec& spec : build_param_table(model)) {
    if (spec.component == Component::vision) table_names.insert(spec.name + " " + spec.shape.str());
  }
  for (const auto& [name, shape] : vision_param_shapes(model.vision)) tower_names.insert(name + " " + shape.str());
  std::printf("  %zu vision tensors in the table, %zu in the tower\n", table_names.size(), tower_names.size());
  EXPECT_EQ(table_names, tower_names);
  EXPECT_EQ(tower_names.size(), static_cast<size_t>(9 + 12 * model.vision.depth));
}

TEST(VisionTower, DepthZeroTowerMatchesADirectComputation) {
  // With no blocks the tower is conv3d + position embedding + merger; recompute that here with a
  // 5-D Conv3d index (not the flattened matrix) and the merger's 2x2 grouping written out.
  VisionConfig config = tiny_config();
  config.depth = 0;
  const VisionParams params = random_params(config, 1, DType::f64);
  Rng rng(2);
  const HostTensor grid = make_grid({1, 2, 2});  // one merge block, 4 patches, pos table corners
  const HostTensor pixels = random_tensor(rng, Shape{4, config.patch_dim()});
  auto param = [&](const std::string& name) { return params.at("model.visual." + name).as<double>(); };
  const int64_t c_dim = config.hidden_size, merged = config.merged_dim();
  // Patch p = (row, col) of a 2x2 grid samples pos_embed corner (row * 3, col * 3) of the 4x4 table.
  std::vector<double> normed(4 * c_dim);
  for (int64_t patch = 0; patch < 4; ++patch) {
    std::vector<double> x(c_dim);
    const int64_t corner = (patch / 2) * 3 * 4 + (patch % 2) * 3;
    for (int64_t o = 0; o < c_dim; ++o) {
      x[o] = param("patch_embed.proj.bias")[o] + param("pos_embed.weight")[corner * c_dim + o];
      for (int64_t ch = 0; ch < 3; ++ch)
        for (int64_t t = 0; t < 2; ++t)
          for (int64_t y = 0; y < 2; ++y)
            for (int64_t xx = 0; xx < 2; ++xx)
              x[o] += param("patch_embed.proj.weight")[(((o * 3 + ch) * 2 + t) * 2 + y) * 2 + xx] *
                      pixels.as<double>()[patch * 24 + ((ch * 2 + t) * 2 + y) * 2 + xx];
    }
    double mean = 0, var = 0;
    for (double value : x) mean += value / c_dim;
    for (double value : x) var += (value - mean) * (value - mean) / c_dim;
    for (int64_t o = 0; o < c_dim; ++o) {
      normed[patch * c_dim + o] =
          (x[o] - mean) / std::sqrt(var + 1e-6) * param("merger.norm.weight")[o] + param("merger.norm.bias")[o];
    }
  }
  std::vector<double> hidden(merged);
  for (int64_t i = 0; i < merged; ++i) {
    double sum = param("merger.linear_fc1.bias")[i];
    for (int64_t j = 0; j < merged; ++j) sum += param("merger.linear_fc1.weight")[i * merged + j] * normed[j];
    hidden[i] = 0.5 * sum * (1 + std::erf(sum / std::sqrt(2.0)));
  }
  const HostTensor features = vision_tower_forward(params, config, pixels, grid).features;
  ASSERT_EQ(features.shape(), (Shape{1, config.out_hidden_size}));
  double max_diff = 0;
  for (int64_t o = 0; o < config.out_hidden_size; ++o) {
    double sum = param("merger.linear_fc2.bias")[o];
    for (int64_t i = 0; i < merged; ++i) sum += param("merger.linear_fc2.weight")[o * merged + i] * hidden[i];
    max_diff = std::max(max_diff, std::abs(sum - features.as<double>()[o]));
  }
  std::printf("  depth-0 tower vs direct conv3d + merger max|diff| = %.3e\n", max_diff);
  EXPECT_LT(max_diff, 1e-12);
}

TEST(VisionTower, ImagesDoNotSeeEachOther) {
  const VisionConfig config = tiny_config();
  const VisionParams params = random_params(config, 3, DType::f64);
  Rng rng(4);
  const HostTensor grid = make_grid({1, 2, 4, 2, 2, 2});  // 8 patches, then a two-frame image of 4 + 4
  HostTensor pixels = random_tensor(rng, Shape{16, config.patch_dim()});
  const HostTensor before = vision_tower_forward(params, config, pixels, grid).features;
  for (int64_t i = 12 * 24; i < 16 * 24; ++i) pixels.as<double>()[i] += 1.0;  // second frame of image 2
  const HostTensor after = vision_tower_forward(params, config, pixels, grid).features;
  ASSERT_EQ(before.shape(), (Shape{4, config.out_hidden_size}));
  double unchanged = 0, changed = 0;
  for (int64_t i = 0; i < 4 * config.out_hidden_size; ++i) {
    const double diff = std::abs(before.as<double>()[i] - after.as<double>()[i]);
    // Merged tokens 0-1 are image 1, token 2 is image 2's first frame, token 3 the edited frame.
    double& bucket = i < 3 * config.out_hidden_size ? unchanged : changed;
    bucket = std::max(bucket, diff);
  }
  std::printf("  change in other images/frames = %.3e, in the edited frame = %.3e\n", unchanged, changed);
  EXPECT_EQ(unchanged, 0.0);
  EXPECT_GT(changed, 1e-3);
}

TEST(VisionTower, Float32AgreesWithFloat64) {
  const VisionConfig config = tiny_config();
  const VisionParams params64 = random_params(config, 5, DType::f64);
  const VisionParams params32 = random_params(config, 5, DType::f32);
  Rng rng(6);
  const HostTensor grid = make_grid({1, 4, 4, 1, 2, 2});
  const HostTensor pixels = random_tensor(rng, Shape{20, config.patch_dim()});
  const HostTensor out64 = vision_tower_forward(params64, config, pixels, grid).features;
  const HostTensor out32 = vision_tower_forward(params32, config, pixels.to_f32(), grid).features;
  double max_diff = 0, max_ref = 0;
  for (int64_t i = 0; i < out64.numel(); ++i) {
    max_diff = std::max(max_diff, std::abs(out64.as<double>()[i] - out32.as<float>()[i]));
    max_ref = std::max(max_ref, std::abs(out64.as<double>()[i]));
  }
  std::printf("  fp32 vs fp64 features max|diff| = %.3e (max|ref| %.3e)\n", max_diff, max_ref);
  EXPECT_LT(max_diff / max_ref, 1e-5);
}

TEST(VisionTower, BackwardMatchesFiniteDifferences) {
  const VisionConfig config = tiny_config();
  VisionParams params = random_params(config, 7, DType::f64);
  Rng rng(8);
  const HostTensor grid = make_grid({1, 2, 4, 2, 2, 2});
  HostTensor pixels = random_tensor(rng, Shape{16, config.patch_dim()});
  const HostTensor d_features = random_tensor(rng, Shape{4, config.out_hidden_size});
  auto loss = [&] {
    const HostTensor features = vision_tower_forward(params, config, pixels, grid).features;
    return gradcheck::dot(to_vector(features), to_vector(d_features));
  };
  const VisionTowerOutput output = vision_tower_forward(params, config, pixels, grid);
  VisionParams grads;
  const HostTensor d_pixels = vision_tower_backward(params, config, output.saved, d_features, &grads);
  ASSERT_EQ(grads.size(), params.size());
  double worst = 0;
  for (auto& [name, tensor] : params) {
    std::vector<double> values = to_vector(tensor);
    auto tensor_loss = [&] {
      std::copy(values.begin(), values.end(), tensor.as<double>());
      return loss();
    };
    const std::string short_name = name.substr(std::string("model.visual.").size());
    const double error = gradcheck::check_gradient(short_name, values, to_vector(grads.at(name)), tensor_loss).relative();
    std::copy(values.begin(), values.end(), tensor.as<double>());  // undo the last perturbation
    worst = std::max(worst, error);
    EXPECT_LT(error, gradcheck::kGradTolerance) << name;
  }
  std::vector<double> pixel_values = to_vector(pixels);
  auto pixel_loss = [&] {
    std::copy(pixel_values.begin(), pixel_values.end(), pixels.as<double>());
    return loss();
  };
  EXPECT_LT(gradcheck::check_gradient("pixel_values", pixel_values, to_vector(d_pixels), pixel_loss).relative(),
            gradcheck::kGradTolerance);
  std::printf("  worst parameter gradient relative error = %.3e\n", worst);
}

}  // namespace
}  // namespace deltamoe
