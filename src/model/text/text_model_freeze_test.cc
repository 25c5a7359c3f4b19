// A frozen language model (TextModel::backward with weight_grads false): it returns no parameter
// gradients, its input-embedding gradient is bitwise that of the trainable backward, it hands the
// kernels no weight-gradient buffer at all (work counters), and its backward is cheaper (CPU time).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>

#include "core/rng.h"
#include "model/config.h"
#include "model/text/text_model.h"

namespace deltamoe {
namespace {

const char* kPrefix = "model";

struct FrozenCase {
  TextConfig config;
  ParamMap params;
  std::vector<float> input_embeds;  // [T, C]
  std::vector<int64_t> ids, shifted_labels;
  int64_t num_tokens = 0;
};

// Two packed sequences on the "tiny" preset, started from random input embeddings as the VLM does.
FrozenCase make_case(int64_t first_len, int64_t second_len) {
  FrozenCase fc;
  fc.config = model_config_preset("tiny").text;
  fc.params = random_text_params(fc.config, kPrefix, 41);
  fc.num_tokens = first_len + second_len;
  Rng rng(42);
  fc.input_embeds.resize(static_cast<size_t>(fc.num_tokens * fc.config.hidden_size));
  for (float& value : fc.input_embeds) value = static_cast<float>(rng.normal());
  for (int64_t t = 0; t < fc.num_tokens; ++t) {
    fc.ids.push_back(static_cast<int64_t>(rng.below(fc.config.vocab_size)));
    fc.shifted_labels.push_back(static_cast<int64_t>(rng.below(fc.config.vocab_size)));
  }
  fc.shifted_labels[first_len - 1] = fc.shifted_labels.back() = -100;  // last token of each sequence
  return fc;
}

TextBatch batch_of(const FrozenCase& fc, int64_t first_len) {
  return make_text_batch(fc.config, fc.num_tokens, {0, static_cast<int32_t>(first_len),
                                                    static_cast<int32_t>(fc.num_tokens)});
}

// Prints the largest difference and fails unless the two buffers hold the same bits.
void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double max_abs = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    max_abs = std::max(max_abs, std::abs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  }
  std::printf("  %-40s n=%zu max_abs=%.3e (scale %.3e)\n", what.c_str(), want.size(), max_abs, scale);
  EXPECT_GT(scale, 0.0) << what << " is all zeros, so the comparison proves nothing";
  EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0) << what << " differs";
}

TEST(TextModelFreeze, FrozenBackwardGivesTheSameInputGradientAndNoWeightGradients) {
  const int64_t first_len = 13, second_len = 19;
  const FrozenCase fc = make_case(first_len, second_len);
  const TextBatch batch = batch_of(fc, first_len);
  for (const bool from_embeds : {true, false}) {
    TextModel model(fc.config, kPrefix, &fc.params);
    TextModelInputs inputs;
    inputs.input_ids = fc.ids.data();
    inputs.input_embeds = from_embeds ? fc.input_embeds.data() : nullptr;
    inputs.shifted_labels = fc.shifted_labels.data();
    model.forward(batch, inputs);
    for (const auto& [ce_weight, aux_weight] : {std::pair{1.0f, 0.0f}, {0.0f, 1.0f}, {1.0f, 0.01f}}) {
      SCOPED_TRACE(testing::Message() << (from_embeds ? "input_embeds" : "input_ids") << " ce " << ce_weight
                                      << " aux " << aux_weight);
      std::vector<float> d_trainable, d_frozen;
      weight_grad_counts() = {};
      const ParamMap trainable_grads = model.backward(ce_weight, aux_weight, &d_trainable, true);
      const WeightGradCounts trainable = weight_grad_counts();
      weight_grad_counts() = {};
      const ParamMap frozen_grads = model.backward(ce_weight, aux_weight, &d_frozen, false);
      const WeightGradCounts frozen = weight_grad_counts();
      EXPECT_FALSE(trainable_grads.empty());
      EXPECT_TRUE(frozen_grads.empty()) << "a frozen language model returned " << frozen_grads.size() << " gradients";
      expect_same_bits(d_frozen, d_trainable, "d_input_embeds frozen vs trainable");
      // Every parameter's gradient product is formed once when trainable (embed_tokens only when the
      // model did the lookup itself) and none when frozen.
      int64_t expected_products = 0, expected_values = 0;
      for (const NamedShape& spec : text_param_shapes(fc.config, kPrefix)) {
        if (from_embeds && spec.name == std::string(kPrefix) + ".embed_tokens.weight") continue;
        ++expected_products;
        int64_t numel = 1;
        for (int64_t dim : spec.shape) numel *= dim;
        expected_values += numel;
      }
      std::printf("  weight-gradient products: trainable %lld computed (%lld values), %lld skipped; frozen %lld "
                  "computed, %lld skipped (%lld values)\n",
                  static_cast<long long>(trainable.computed), static_cast<long long>(trainable.computed_values),
                  static_cast<long long>(trainable.skipped), static_cast<long long>(frozen.computed),
                  static_cast<long long>(frozen.skipped), static_cast<long long>(frozen.skipped_values));
      EXPECT_EQ(trainable.computed, expected_products);
      EXPECT_EQ(trainable.computed_values, expected_values);
      EXPECT_EQ(trainable.skipped, 0);
      EXPECT_EQ(frozen.computed, 0) << "a frozen language model still formed weight gradients";
      EXPECT_EQ(frozen.skipped, expected_products);
      EXPECT_EQ(frozen.skipped_values, expected_values);
    }
  }
}

// CPU time of the calling thread: the reference backward is single-threaded, and unlike wall time
// this does not count the time the thread waits while other processes hold the cores.
double thread_cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

TEST(TextModelFreeze, FrozenBackwardTakesLessCpuTime) {
  const int64_t first_len = 60, second_len = 68;
  const FrozenCase fc = make_case(first_len, second_len);
  const TextBatch batch = batch_of(fc, first_len);
  TextModel model(fc.config, kPrefix, &fc.params);
  TextModelInputs inputs;
  inputs.input_embeds = fc.input_embeds.data();
  inputs.shifted_labels = fc.shifted_labels.data();
  model.forward(batch, inputs);
  // Best of 7 alternating runs of each, in thread CPU time (wall time printed for reference): a busy
  // machine slows single runs and evicts caches, but rarely spoils the best of several.
  constexpr int kRepeats = 7;
  double best_cpu[2] = {1e30, 1e30}, best_wall[2] = {1e30, 1e30};
  for (int repeat = 0; repeat < kRepeats; ++repeat) {
    for (const bool weight_grads : {true, false}) {
      std::vector<float> d_embeds;
      const double cpu_start = thread_cpu_seconds();
      const auto wall_start = std::chrono::steady_clock::now();
      const ParamMap grads = model.backward(1.0f, 0.01f, &d_embeds, weight_grads);
      const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
      const double cpu = thread_cpu_seconds() - cpu_start;
      const int slot = weight_grads ? 0 : 1;
      best_cpu[slot] = std::min(best_cpu[slot], cpu);
      best_wall[slot] = std::min(best_wall[slot], wall);
    }
  }
  const double ratio = best_cpu[1] / best_cpu[0];
  std::printf(
      "  backward of %lld tokens (best of %d): trainable %.2f ms CPU (%.2f ms wall), frozen %.2f ms CPU (%.2f ms "
      "wall); frozen / trainable = %.0f%% CPU (%.0f%% wall)\n",
      static_cast<long long>(fc.num_tokens), kRepeats, 1e3 * best_cpu[0], 1e3 * best_wall[0], 1e3 * best_cpu[1],
      1e3 * best_wall[1], 100 * ratio, 100 * best_wall[1] / best_wall[0]);
  // The frozen backward still forms every input gradient (the dx products, lm_head's the largest,
  // were ~40% of its profile) and the expert kernels recompute their forward in both modes, so on
  // this preset it takes ~70% of the trainable backward: callgrind counted 263M vs 386M instructions
  // (68%; 74% while norms, conv, gates and experts still filled throwaway buffers). On the shared VM
  // even CPU time swings by tens of percent, so the firm checks are the work counters above; this
  // asserts only the direction, and prints the numbers.
  EXPECT_LT(ratio, 1.0) << "the frozen backward should skip every weight-gradient product";
}

}  // namespace
}  // namespace deltamoe
