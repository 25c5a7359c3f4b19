// Vision tower forward/backward from the reference ops; the per-block math is in vision_block.cc.
#include "model/vision/vision_tower.h"

#include <cmath>

#include "core/error.h"
#include "kernels/bias_add/bias_add.h"
#include "kernels/gelu/gelu.h"
#include "kernels/layer_norm/layer_norm.h"
#include "kernels/linear/linear.h"
#include "model/vision/vision_projection.h"
#include "kernels/vision_grid/vision_grid.h"
#include "kernels/vision_pos_embed/vision_pos_embed.h"
#include "kernels/vision_rope/vision_rope.h"
#include "model/param_table.h"
#include "model/vision/vision_block.h"

namespace deltamoe {
namespace {

constexpr double kLayerNormEps = 1e-6;
constexpr double kVisionRopeTheta = 10000.0;

template <typename T>
struct TowerState {
  VisionLayout<T> layout;
  HostTensor pixel_values;                 // [N, patch_dim] (shared, not copied)
  std::vector<int64_t> pos_index;          // [N, 4]
  std::vector<T> pos_weight;               // [N, 4]
  std::vector<VisionBlockSaved<T>> blocks;
  std::vector<T> merger_in, merger_norm, merger_mean, merger_rstd, merger_fc1, merger_act;
};

std::string block_prefix(const std::string& prefix, int64_t block) {
  return str_cat(prefix, ".blocks.", block, ".");
}

int64_t grid_side(const VisionConfig& config) {
  const auto side = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(config.num_position_embeddings))));
  CHECK(side * side == config.num_position_embeddings, "vision config: num_position_embeddings ",
        config.num_position_embeddings, " is not a square");
  return side;
}

template <typename T>
VisionTowerOutput forward_impl(const VisionParams& params, const VisionConfig& config, const HostTensor& pixel_values,
                               const HostTensor& grid_thw, const std::string& prefix) {
  const int64_t c = config.hidden_size, m = config.spatial_merge_size, k = config.patch_dim();
  CHECK(grid_thw.dtype() == DType::i64 && grid_thw.shape().rank() == 2 && grid_thw.shape()[1] == 3,
        "vision tower: image_grid_thw must be int64 [I, 3], got ", dtype_name(grid_thw.dtype()), " ",
        grid_thw.shape().str());
  const int64_t num_images = grid_thw.shape()[0];
  const int64_t* grids = grid_thw.as<int64_t>();
  const int64_t n = vision_num_patches(grids, num_images);
  CHECK(pixel_values.shape().rank() == 2 && pixel_values.shape()[0] == n && pixel_values.shape()[1] == k,
        "vision tower: pixel_values must be [", n, ", ", k, "] for image_grid_thw, got ", pixel_values.shape().str());
  CHECK(n % (m * m) == 0, "vision tower: patch count ", n, " is not a multiple of ", m * m);

  auto state = std::make_shared<TowerState<T>>();
  state->pixel_values = pixel_values;
  VisionLayout<T>& layout = state->layout;
  layout.num_patches = n;
  layout.cu_seqlens = {0};
  for (int64_t i = 0; i < num_images; ++i) {
    for (int64_t frame = 0; frame < grids[i * 3]; ++frame) {
      layout.cu_seqlens.push_back(static_cast<int32_t>(layout.cu_seqlens.back() + grids[i * 3 + 1] * grids[i * 3 + 2]));
    }
  }
  std::vector<int64_t> positions(n * 2);
  vision_rope_positions(grids, num_images, m, positions.data());
  const int64_t half = config.head_dim() / 2;
  layout.rope_cos.resize(n * half), layout.rope_sin.resize(n * half);
  vision_rope_tables_ref(positions.data(), n, config.head_dim(), kVisionRopeTheta, layout.rope_cos.data(),
                         layout.rope_sin.data());

  // Patch embedding: Conv3d with kernel = stride = (Tp, P, P) is a matrix product with the
  // weight flattened in (channel, t, y, x) order, which is also the pixel_values row order.
  std::vector<T> x(n * c);
  linear_forward_ref(pixel_values.as<T>(), vision_param<T>(params, prefix + ".patch_embed.proj.weight", c * k),
                     x.data(), n, k, c);
  bias_add_forward_ref(vision_param<T>(params, prefix + ".patch_embed.proj.bias", c), x.data(), n, c);
  const int64_t side = grid_side(config);
  state->pos_index.resize(n * 4), state->pos_weight.resize(n * 4);
  vision_pos_embed_taps(grids, num_images, side, m, state->pos_index.data(), state->pos_weight.data());
  vision_pos_embed_forward_ref(vision_param<T>(params, prefix + ".pos_embed.weight", side * side * c),
                               state->pos_index.data(), state->pos_weight.data(), x.data(), n, c);

  state->blocks.resize(config.depth);
  for (int64_t j = 0; j < config.depth; ++j) {
    vision_block_forward(config, params, block_prefix(prefix, j), layout, x, state->blocks[j]);
  }

  // Merger: LayerNorm per patch, then each run of m^2 consecutive patches (one merge block) is one row.
  const int64_t rows = n / (m * m), merged = config.merged_dim(), out_dim = config.out_hidden_size;
  state->merger_in = x;
  state->merger_norm.resize(n * c), state->merger_mean.resize(n), state->merger_rstd.resize(n);
  layer_norm_forward_ref(x.data(), vision_param<T>(params, prefix + ".merger.norm.weight", c),
                         vision_param<T>(params, prefix + ".merger.norm.bias", c), state->merger_norm.data(),
                         state->merger_mean.data(), state->merger_rstd.data(), n, c, kLayerNormEps);
  state->merger_fc1.resize(rows * merged), state->merger_act.resize(rows * merged);
  vision_project_forward(params, prefix + ".merger.linear_fc1", state->merger_norm.data(), state->merger_fc1.data(),
                         rows, merged, merged);
  gelu_forward_ref(GeluKind::exact, state->merger_fc1.data(), state->merger_act.data(), rows * merged);
  VisionTowerOutput output;
  output.features = HostTensor(DTypeOf<T>::value, Shape{rows, out_dim});
  T* features = output.features.as<T>();
  vision_project_forward(params, prefix + ".merger.linear_fc2", state->merger_act.data(), features, rows, merged,
                         out_dim);
  output.saved = {DTypeOf<T>::value, state};
  return output;
}

template <typename T>
HostTensor backward_impl(const VisionParams& params, const VisionConfig& config, const VisionTowerSaved& saved,
                         const HostTensor& d_features, VisionParams& grads, const std::string& prefix,
                         const TrainableParts& trainable) {
  const auto& state = *static_cast<const TowerState<T>*>(saved.state.get());
  const int64_t n = state.layout.num_patches, c = config.hidden_size, m = config.spatial_merge_size;
  const int64_t rows = n / (m * m), merged = config.merged_dim(), out_dim = config.out_hidden_size;
  const int64_t k = config.patch_dim();
  CHECK(d_features.dtype() == DTypeOf<T>::value && d_features.numel() == rows * out_dim,
        "vision tower backward: d_features must be ", dtype_name(DTypeOf<T>::value), " [", rows, ", ", out_dim,
        "], got ", dtype_name(d_features.dtype()), " ", d_features.shape().str());
  // A frozen tensor has no entry in grads (vision_tower_backward adds the trained ones): its weight
  // product is skipped (null gradient); input gradients are still formed for what lies below.
  auto grad = [&](const std::string& name, int64_t numel) { return optional_vision_grad<T>(&grads, prefix + name, numel); };
  std::vector<T> d_act(rows * merged), d_fc1(rows * merged), d_norm(n * c), dx(n * c);
  vision_project_backward(params, &grads, prefix + ".merger.linear_fc2", state.merger_act.data(), d_features.as<T>(),
                          d_act.data(), rows, merged, out_dim);
  gelu_backward_ref(GeluKind::exact, state.merger_fc1.data(), d_act.data(), d_fc1.data(), rows * merged);
  vision_project_backward(params, &grads, prefix + ".merger.linear_fc1", state.merger_norm.data(), d_fc1.data(),
                          d_norm.data(), rows, merged, merged);
  layer_norm_backward_ref(state.merger_in.data(), vision_param<T>(params, prefix + ".merger.norm.weight", c),
                          state.merger_mean.data(), state.merger_rstd.data(), d_norm.data(), dx.data(),
                          grad(".merger.norm.weight", c), grad(".merger.norm.bias", c), n, c);
  if (!trainable.vit) return HostTensor();  // nothing below the merger is trained: no block backward

  for (int64_t j = config.depth - 1; j >= 0; --j) {
    vision_block_backward(config, params, block_prefix(prefix, j), state.layout, state.blocks[j], dx, grads);
  }

  const int64_t side = grid_side(config);
  if (T* d_pos = grad(".pos_embed.weight", side * side * c)) {
    vision_pos_embed_backward_ref(dx.data(), state.pos_index.data(), state.pos_weight.data(), d_pos, n, c);
  }
  HostTensor d_pixels(DTypeOf<T>::value, Shape{n, k});
  linear_backward_ref(state.pixel_values.template as<T>(), vision_param<T>(params, prefix + ".patch_embed.proj.weight", c * k),
                      dx.data(), d_pixels.as<T>(), grad(".patch_embed.proj.weight", c * k), n, k, c);
  if (T* d_bias = grad(".patch_embed.proj.bias", c)) bias_add_backward_ref(dx.data(), d_bias, n, c);
  return d_pixels;
}

}  // namespace

std::vector<std::pair<std::string, Shape>> vision_param_shapes(const VisionConfig& config, const std::string& prefix) {
  std::vector<std::pair<std::string, Shape>> shapes;  // the parameter table's names, shapes and order
  for (const ParamSpec& spec : vision_param_table(config, prefix)) shapes.emplace_back(spec.name, spec.shape);
  return shapes;
}

int64_t vision_num_merged_tokens(const HostTensor& grid_thw, int64_t merge_size) {
  CHECK(grid_thw.dtype() == DType::i64 && grid_thw.shape().rank() == 2 && grid_thw.shape()[1] == 3,
        "image_grid_thw must be int64 [I, 3], got ", grid_thw.shape().str());
  return vision_num_patches(grid_thw.as<int64_t>(), grid_thw.shape()[0]) / (merge_size * merge_size);
}

VisionTowerOutput vision_tower_forward(const VisionParams& params, const VisionConfig& config,
                                       const HostTensor& pixel_values, const HostTensor& grid_thw,
                                       const std::string& prefix) {
  CHECK(config.deepstack_visual_indexes.empty(), "vision tower: deepstack features are not part of Qwen3.5");
  CHECK(config.hidden_size % config.num_heads == 0 && config.head_dim() % 4 == 0, "vision config: hidden_size ",
        config.hidden_size, " / num_heads ", config.num_heads, " must give a head dim divisible by 4");
  switch (pixel_values.dtype()) {
    case DType::f32: return forward_impl<float>(params, config, pixel_values, grid_thw, prefix);
    case DType::f64: return forward_impl<double>(params, config, pixel_values, grid_thw, prefix);
    default: RAISE("vision tower: pixel_values must be f32 (or f64 in tests), got ", dtype_name(pixel_values.dtype()));
  }
}

HostTensor vision_tower_backward(const VisionParams& params, const VisionConfig& config,
                                 const VisionTowerSaved& saved, const HostTensor& d_features, VisionParams* grads,
                                 const std::string& prefix, const TrainableParts& trainable) {
  CHECK(saved.state != nullptr, "vision tower backward: no saved forward state");
  CHECK(grads != nullptr, "vision tower backward: grads must not be null");
  const std::string merger_prefix = prefix + ".merger.";
  for (const auto& [name, shape] : vision_param_shapes(config, prefix)) {
    const bool in_merger = name.compare(0, merger_prefix.size(), merger_prefix) == 0;
    if (!(in_merger ? trainable.aligner : trainable.vit) || !trainable.base_weights) continue;  // frozen: no entry
    if (grads->find(name) == grads->end()) grads->emplace(name, HostTensor(saved.dtype, shape));
  }
  if (saved.dtype == DType::f64) {
    return backward_impl<double>(params, config, saved, d_features, *grads, prefix, trainable);
  }
  return backward_impl<float>(params, config, saved, d_features, *grads, prefix, trainable);
}

}  // namespace deltamoe
