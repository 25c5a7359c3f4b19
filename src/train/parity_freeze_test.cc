// Freezing in the CPU reference (TrainableParts through run_parity_cpu) on a random tiny VLM with two
// images: frozen parts get no gradient entries, the unfrozen parts' gradients are bitwise those of
// the fully trainable run, and the skipped backward work really is skipped (structure and timing).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "checkpoint/random_init.h"
#include "core/rng.h"
#include "model/config.h"
#include "model/text/text_params.h"
#include "model/vision/vision_tower.h"
#include "train/parity.h"

namespace deltamoe {
namespace {

enum class Part { vit, aligner, llm };

Part part_of(const std::string& name) {
  const std::string visual = std::string(kVisionPrefix) + ".", merger = std::string(kVisionPrefix) + ".merger.";
  if (name.compare(0, merger.size(), merger) == 0) return Part::aligner;
  if (name.compare(0, visual.size(), visual) == 0) return Part::vit;
  return Part::llm;
}

bool is_trainable(const TrainableParts& parts, Part part) {
  return part == Part::vit ? parts.vit : part == Part::aligner ? parts.aligner : parts.llm;
}

std::string describe(const TrainableParts& parts) {
  std::string text;
  if (!parts.vit) text += "vit ";
  if (!parts.aligner) text += "aligner ";
  if (!parts.llm) text += "llm ";
  return text.empty() ? "nothing frozen" : "frozen: " + text;
}

HostTensor i64_tensor(const std::vector<int64_t>& values, Shape shape) {
  HostTensor tensor(DType::i64, shape);
  std::memcpy(tensor.data(), values.data(), values.size() * sizeof(int64_t));
  return tensor;
}

class ParityFreeze : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelConfig config = model_config_preset("tiny-vl");
    checkpoint_ = random_init_checkpoint(config, 23, DType::f32);
    // Two images: grids (1, 8, 8) and (1, 4, 6), i.e. 16 and 6 merged tokens; text around them.
    const std::vector<int64_t> grids = {1, 8, 8, 1, 4, 6};
    const int64_t patches = 64 + 24, patch_dim = config.vision.patch_dim();
    std::vector<int64_t> ids;
    auto text = [&](int count) {
      for (int i = 0; i < count; ++i) ids.push_back(static_cast<int64_t>((ids.size() * 131 + 7) % 4000));
    };
    auto image = [&](int merged_tokens) {
      ids.push_back(config.vision_start_token_id);
      ids.insert(ids.end(), merged_tokens, config.image_token_id);
      ids.push_back(config.vision_end_token_id);
    };
    text(9), image(16), text(5), image(6), text(12);
    std::vector<int64_t> labels(ids), types(ids.size(), 0);
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] == config.image_token_id) labels[i] = -100, types[i] = 1;
    }
    const int64_t seq_len = static_cast<int64_t>(ids.size());
    inputs_.input_ids = i64_tensor(ids, Shape{1, seq_len});
    inputs_.labels = i64_tensor(labels, Shape{1, seq_len});
    inputs_.mm_token_type_ids = i64_tensor(types, Shape{1, seq_len});
    inputs_.image_grid_thw = i64_tensor(grids, Shape{2, 3});
    std::vector<float> pixels(static_cast<size_t>(patches * patch_dim));
    Rng rng(5);
    for (float& value : pixels) value = static_cast<float>(rng.normal());
    inputs_.pixel_values = HostTensor::from_f32(pixels, Shape{patches, patch_dim});
  }

  ModelCheckpoint checkpoint_;
  ParityInputs inputs_;
};

void expect_bitwise_equal(const HostTensor& got, const HostTensor& want, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  EXPECT_EQ(std::memcmp(got.data(), want.data(), static_cast<size_t>(got.numel()) * sizeof(float)), 0)
      << what << " differs from the fully trainable run";
}

TEST_F(ParityFreeze, FrozenPartsHaveNoGradientsAndTheRestIsBitwiseUnchanged) {
  const ParityResult full = run_parity_cpu(checkpoint_, inputs_);
  int counts[3] = {0, 0, 0};
  for (const auto& [name, grad] : full.grads) ++counts[static_cast<int>(part_of(name))];
  std::printf("  trainable run: %zu gradient tensors (vit %d, aligner %d, llm %d)\n", full.grads.size(), counts[0],
              counts[1], counts[2]);
  ASSERT_EQ(counts[0], 3 + 12 * checkpoint_.config.vision.depth);
  ASSERT_EQ(counts[1], 6);
  ASSERT_GT(counts[2], 0);
  for (int mask = 1; mask < 8; ++mask) {
    TrainableParts parts;
    parts.vit = !(mask & 1), parts.aligner = !(mask & 2), parts.llm = !(mask & 4);
    const ParityResult frozen = run_parity_cpu(checkpoint_, inputs_, parts);
    SCOPED_TRACE(describe(parts));
    EXPECT_EQ(frozen.ce_loss, full.ce_loss);
    EXPECT_EQ(frozen.aux_loss, full.aux_loss);
    expect_bitwise_equal(frozen.logits, full.logits, "logits");
    size_t compared = 0;
    for (const auto& [mine, reference] :
         {std::pair{&frozen.grads, &full.grads}, {&frozen.grads_aux, &full.grads_aux}}) {
      for (const auto& [name, grad] : *mine) {
        EXPECT_TRUE(is_trainable(parts, part_of(name))) << name << " is frozen but has a gradient";
      }
      for (const auto& [name, grad] : *reference) {
        if (!is_trainable(parts, part_of(name))) continue;
        auto it = mine->find(name);
        if (it == mine->end()) {
          ADD_FAILURE() << name << " is trainable but has no gradient";
          continue;
        }
        expect_bitwise_equal(it->second, grad, name);
        ++compared;
      }
    }
    std::printf("  %-28s %3zu gradient tensors (ce + aux), all bitwise equal to the trainable run\n",
                describe(parts).c_str(), compared);
    if (!parts.vit && !parts.aligner && !parts.llm) {
      EXPECT_EQ(frozen.backward_seconds, 0.0) << "nothing is trained, yet a backward ran";
    }
  }
}

// The vision tower alone: a frozen ViT stops the backward after the merger (no d_pixel_values, no
// block entries); a frozen merger still passes the gradient down to the blocks.
TEST_F(ParityFreeze, VisionBackwardStopsAtTheFrozenPart) {
  const ModelConfig& config = checkpoint_.config;
  VisionParams params;
  for (const auto& [name, shape] : vision_param_shapes(config.vision)) {
    params[name] = checkpoint_.params.at(name).to_host().to_f32();
  }
  const VisionTowerOutput out =
      vision_tower_forward(params, config.vision, *inputs_.pixel_values, *inputs_.image_grid_thw);
  std::vector<float> ones(static_cast<size_t>(out.features.numel()), 1.0f);
  const HostTensor d_features = HostTensor::from_f32(ones, out.features.shape());
  VisionParams all, merger_only, vit_only;
  const HostTensor d_pixels_all = vision_tower_backward(params, config.vision, out.saved, d_features, &all);
  const HostTensor d_pixels_merger = vision_tower_backward(params, config.vision, out.saved, d_features, &merger_only,
                                                           kVisionPrefix, {false, true, true});
  const HostTensor d_pixels_vit = vision_tower_backward(params, config.vision, out.saved, d_features, &vit_only,
                                                        kVisionPrefix, {true, false, true});
  std::printf("  d_pixel_values: trainable %s, ViT frozen %s, merger frozen %s; entries %zu / %zu / %zu\n",
              d_pixels_all.shape().str().c_str(), d_pixels_merger.empty() ? "none" : "computed",
              d_pixels_vit.shape().str().c_str(), all.size(), merger_only.size(), vit_only.size());
  EXPECT_TRUE(d_pixels_merger.empty()) << "a frozen ViT must not run the block/patch-embedding backward";
  EXPECT_FALSE(d_pixels_all.empty());
  expect_bitwise_equal(d_pixels_vit, d_pixels_all, "d_pixel_values with the merger frozen");
  EXPECT_EQ(merger_only.size(), 6u);
  EXPECT_EQ(vit_only.size() + merger_only.size(), all.size());
  for (const auto& [name, grad] : merger_only) expect_bitwise_equal(grad, all.at(name), name);
  for (const auto& [name, grad] : vit_only) expect_bitwise_equal(grad, all.at(name), name);
}

// Skipped work: freezing the vision side removes most of the backward, which shows in the time
// (best of several runs, the variants measured in turn so that a busy machine slows all of them
// alike); freezing the language model removes its weight-gradient products, which are counted
// (weight_grad_counts) rather than timed — they are a small share of this model's backward.
TEST_F(ParityFreeze, FrozenPartsCostNoBackwardTime) {
  const std::vector<TrainableParts> variants = {
      {}, {false, false, true}, {true, true, false}, {false, true, true}, {true, false, false}};
  std::vector<double> best(variants.size(), 1e30);
  WeightGradCounts llm_frozen_counts;
  for (int repeat = 0; repeat < 5; ++repeat) {
    for (size_t v = 0; v < variants.size(); ++v) {
      weight_grad_counts() = WeightGradCounts{};
      best[v] = std::min(best[v], run_parity_cpu(checkpoint_, inputs_, variants[v]).backward_seconds);
      if (v == 2) llm_frozen_counts = weight_grad_counts();
    }
  }
  const double full = best[0], vision_frozen = best[1], llm_frozen = best[2], vit_frozen = best[3],
               llm_and_merger_frozen = best[4];
  std::printf(
      "  backward (best of 5): trainable %.2f ms, vit+aligner frozen %.2f ms (%.0f%%), llm frozen %.2f ms "
      "(%.0f%%), vit frozen %.2f ms (%.0f%%), llm+aligner frozen %.2f ms (%.0f%%)\n",
      1e3 * full, 1e3 * vision_frozen, 100 * vision_frozen / full, 1e3 * llm_frozen, 100 * llm_frozen / full,
      1e3 * vit_frozen, 100 * vit_frozen / full, 1e3 * llm_and_merger_frozen, 100 * llm_and_merger_frozen / full);
  std::printf("  llm frozen: %lld weight-gradient products computed, %lld skipped\n",
              static_cast<long long>(llm_frozen_counts.computed), static_cast<long long>(llm_frozen_counts.skipped));
  EXPECT_LT(vision_frozen, full);
  EXPECT_LT(vit_frozen, full);
  EXPECT_EQ(llm_frozen_counts.computed, 0);
  EXPECT_GT(llm_frozen_counts.skipped, 0);
  // (llm+aligner frozen only drops the merger's small weight products: printed, not asserted.)
}

}  // namespace
}  // namespace deltamoe
