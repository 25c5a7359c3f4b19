// Whole-model checks of the CPU text tower on a tiny random Qwen3.5-MoE: packed sequences equal
// rows and one-by-one runs, parameter gradients agree with finite differences along random
// directions (both losses), and a forward + backward of 64 tokens is fast enough.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

#include "core/error.h"
#include "core/rng.h"
#include "kernels/cross_entropy/cross_entropy.h"
#include "model/text/text_model.h"

namespace deltamoe {
namespace {

const char* kPrefix = "model";

TextConfig tiny_config(int64_t num_layers = 4) {
  TextConfig c;
  c.vocab_size = 512;
  c.hidden_size = 64;
  c.num_hidden_layers = num_layers;
  c.layer_types.clear();
  for (int64_t i = 0; i < num_layers; ++i)
    c.layer_types.push_back((i + 1) % 4 == 0 ? LayerType::full_attention : LayerType::linear_attention);
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.rope_theta = 1e7;
  c.partial_rotary_factor = 0.25;
  c.mrope_section = {2, 1, 1};
  c.linear_conv_kernel_dim = 4;
  c.linear_num_key_heads = 2;
  c.linear_num_value_heads = 4;
  c.linear_key_head_dim = 16;
  c.linear_value_head_dim = 16;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 32;
  c.shared_expert_intermediate_size = 32;
  c.rms_norm_eps = 1e-6;
  return c;
}

std::vector<int64_t> random_ids(Rng& rng, int64_t count, int64_t vocab) {
  std::vector<int64_t> ids(count);
  for (auto& id : ids) id = static_cast<int64_t>(rng.below(vocab));
  return ids;
}

// max |a - b| / max |b|.
double relative_max_diff(const float* a, const float* b, size_t count) {
  double diff = 0, ref = 0;
  for (size_t i = 0; i < count; ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
    ref = std::max(ref, std::abs(double(b[i])));
  }
  return diff / std::max(ref, 1e-30);
}

double worst_grad_diff(const ParamMap& a, const ParamMap& b, std::string* worst_name) {
  double worst = 0;
  *worst_name = "all identical";
  for (const auto& [name, tensor] : b) {
    const double diff = relative_max_diff(a.at(name).values.data(), tensor.values.data(), tensor.values.size());
    if (diff > worst) worst = diff, *worst_name = name;
  }
  return worst;
}

TEST(TextModel, PackedEqualLengthSequencesEqualRows) {
  const TextConfig config = tiny_config();
  const ParamMap params = random_text_params(config, kPrefix, 21);
  const int64_t rows = 3, seq_len = 20, T = rows * seq_len;
  Rng rng(22);
  const std::vector<int64_t> ids = random_ids(rng, T, config.vocab_size);
  std::vector<int64_t> labels = random_ids(rng, T, config.vocab_size);
  labels[5] = labels[27] = kIgnoreIndex;
  // The packer marks each sequence's first label ignored so the packed row's shift learns nothing
  // across boundaries; a row's first label is never used anyway.
  for (int64_t b = 0; b < rows; ++b) labels[b * seq_len] = kIgnoreIndex;
  std::vector<int64_t> shifted_rows(T), shifted_packed(T);
  shift_labels_ref(labels.data(), shifted_rows.data(), rows, seq_len);
  shift_labels_ref(labels.data(), shifted_packed.data(), 1, T);

  TextModel as_rows(config, kPrefix, &params), packed(config, kPrefix, &params);
  const TextModelOutput out_rows = as_rows.forward(make_text_batch(config, T, row_cu_seqlens(rows, seq_len)),
                                                   {ids.data(), nullptr, shifted_rows.data()});
  const std::vector<int32_t> cu = {0, 20, 40, 60};
  const TextModelOutput out_packed =
      packed.forward(make_text_batch(config, T, cu), {ids.data(), nullptr, shifted_packed.data()});
  const double logits_diff =
      relative_max_diff(out_packed.logits.data(), out_rows.logits.data(), out_rows.logits.size());
  std::printf("  ce %.8f vs %.8f, aux %.8f vs %.8f, logits rel diff %.3e\n", out_packed.ce_loss, out_rows.ce_loss,
              out_packed.aux_loss, out_rows.aux_loss, logits_diff);
  EXPECT_EQ(out_packed.num_supervised, out_rows.num_supervised);
  EXPECT_NEAR(out_packed.ce_loss, out_rows.ce_loss, 1e-5 * out_rows.ce_loss);
  EXPECT_NEAR(out_packed.aux_loss, out_rows.aux_loss, 1e-5 * out_rows.aux_loss);
  EXPECT_LT(logits_diff, 1e-5);
  for (auto [ce_weight, aux_weight] : {std::pair{1.0f, 0.0f}, std::pair{0.0f, 1.0f}}) {
    std::string worst_name;
    const double worst =
        worst_grad_diff(packed.backward(ce_weight, aux_weight), as_rows.backward(ce_weight, aux_weight), &worst_name);
    std::printf("  %s gradients: worst rel diff %.3e (%s)\n", ce_weight != 0 ? "ce" : "aux", worst, worst_name.c_str());
    EXPECT_LT(worst, 1e-5);
  }
}

TEST(TextModel, PackedEqualsOneByOne) {
  const TextConfig config = tiny_config();
  const ParamMap params = random_text_params(config, kPrefix, 23);
  const std::vector<int32_t> cu = {0, 13, 42, 64};
  const int64_t T = 64;
  Rng rng(24);
  const std::vector<int64_t> ids = random_ids(rng, T, config.vocab_size);
  std::vector<int64_t> labels = random_ids(rng, T, config.vocab_size);
  labels[30] = kIgnoreIndex;
  for (size_t s = 0; s + 1 < cu.size(); ++s) labels[cu[s]] = kIgnoreIndex;
  std::vector<int64_t> shifted(T);
  shift_labels_ref(labels.data(), shifted.data(), 1, T);
  TextModel packed(config, kPrefix, &params);
  const TextModelOutput out_packed =
      packed.forward(make_text_batch(config, T, cu), {ids.data(), nullptr, shifted.data()});
  // Compare sums of per-token losses: the packed mean covers all supervised tokens at once.
  ParamMap packed_grads = packed.backward(static_cast<float>(out_packed.num_supervised), 0.0f);
  ParamMap summed = zeros_like(params);
  double logits_diff = 0, ce_sum = 0;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    const int64_t begin = cu[s], len = cu[s + 1] - cu[s];
    std::vector<int64_t> seq_shifted(len);
    shift_labels_ref(labels.data() + begin, seq_shifted.data(), 1, len);
    TextModel single(config, kPrefix, &params);
    const TextModelOutput out = single.forward(make_text_batch(config, len, {0, static_cast<int32_t>(len)}),
                                               {ids.data() + begin, nullptr, seq_shifted.data()});
    logits_diff = std::max(logits_diff, relative_max_diff(out_packed.logits.data() + begin * config.vocab_size,
                                                          out.logits.data(), out.logits.size()));
    ce_sum += out.ce_loss * out.num_supervised;
    const ParamMap grads = single.backward(static_cast<float>(out.num_supervised), 0.0f);
    for (auto& [name, tensor] : summed)
      for (size_t i = 0; i < tensor.values.size(); ++i) tensor.values[i] += grads.at(name).values[i];
  }
  std::string worst_name;
  const double worst = worst_grad_diff(packed_grads, summed, &worst_name);
  const double packed_sum = out_packed.ce_loss * out_packed.num_supervised;
  std::printf("  CE sums %.6f vs %.6f, logits rel diff %.3e, worst grad rel diff %.3e (%s)\n", packed_sum, ce_sum,
              logits_diff, worst, worst_name.c_str());
  EXPECT_NEAR(packed_sum, ce_sum, 1e-5 * ce_sum);
  EXPECT_LT(logits_diff, 1e-5);
  EXPECT_LT(worst, 1e-5);
}

// Every layer's expert choice of the last forward, to pin it in the probes: top-k is piecewise
// constant, so a finite difference is only meaningful with the routing held fixed.
std::vector<std::vector<int32_t>> routing_of(const TextModel& model) {
  std::vector<std::vector<int32_t>> routing;
  for (const DecoderLayerSaved& layer : model.saved_layers()) routing.push_back(layer.moe.topk_idx);
  return routing;
}

// Directional derivatives of each loss, per parameter tensor, along a unit direction half random and
// half along the analytic gradient (so the derivative stands well above the fp32 noise of the
// model), against Richardson-extrapolated central differences of the fp32 model with the routing
// pinned: checks the whole backward chain tensor by tensor, for both losses.
TEST(TextModel, GradientsMatchDirectionalFiniteDifferences) {
  const TextConfig config = tiny_config();
  ParamMap params = random_text_params(config, kPrefix, 25);
  const std::vector<int32_t> cu = {0, 9, 24};
  const int64_t T = 24;
  Rng rng(26);
  const std::vector<int64_t> ids = random_ids(rng, T, config.vocab_size);
  std::vector<int64_t> labels = random_ids(rng, T, config.vocab_size), shifted(T);
  labels[9] = kIgnoreIndex;
  shift_labels_ref(labels.data(), shifted.data(), 1, T);
  const TextBatch batch = make_text_batch(config, T, cu);
  TextModel model(config, kPrefix, &params);
  model.forward(batch, {ids.data(), nullptr, shifted.data()});
  const std::vector<std::vector<int32_t>> routing = routing_of(model);
  const ParamMap grads[2] = {model.backward(1.0f, 0.0f), model.backward(0.0f, 1.0f)};
  const char* loss_names[2] = {"ce", "aux"};
  constexpr double kMaxStep = 1e-2, kLossChange = 1e-3;
  double worst = 0;
  std::string worst_name;
  int checked = 0;
  for (auto& [name, tensor] : params) {
    for (int loss_idx = 0; loss_idx < 2; ++loss_idx) {
      const std::vector<float>& grad = grads[loss_idx].at(name).values;
      double grad_norm = 0;
      for (float g : grad) grad_norm += double(g) * g;
      grad_norm = std::sqrt(grad_norm);
      std::vector<double> direction(grad.size());
      double random_norm = 0;
      for (double& u : direction) {
        u = rng.normal();
        random_norm += u * u;
      }
      double norm = 0;
      for (size_t i = 0; i < grad.size(); ++i) {
        direction[i] = direction[i] / std::sqrt(random_norm) + (grad_norm > 0 ? grad[i] / grad_norm : 0.0);
        norm += direction[i] * direction[i];
      }
      for (double& u : direction) u /= std::sqrt(norm);
      auto loss_at = [&](double offset) {
        const std::vector<float> saved = tensor.values;
        for (size_t i = 0; i < saved.size(); ++i)
          tensor.values[i] = static_cast<float>(saved[i] + offset * direction[i]);
        TextModel probe(config, kPrefix, &params);
        const TextModelOutput out = probe.forward(batch, {ids.data(), nullptr, shifted.data(), &routing});
        tensor.values = saved;
        return loss_idx == 0 ? out.ce_loss : out.aux_loss;
      };
      double analytic = 0;
      for (size_t i = 0; i < direction.size(); ++i) analytic += direction[i] * grad[i];
      // The step moves the loss by about kLossChange: large enough to stand above fp32 noise,
      // small enough to stay in the quadratic regime of steep directions.
      const double step = std::min(kMaxStep, kLossChange / std::max(std::abs(analytic), 1e-12));
      auto central = [&](double h) { return (loss_at(h) - loss_at(-h)) / (2 * h); };
      // Richardson: (4 D(h/2) - D(h)) / 3 cancels the h^2 term of the central difference.
      const double numeric = (4 * central(step / 2) - central(step)) / 3;
      // Relative to the derivative, with an absolute floor for fp32 rounding inside the model.
      const double error = std::abs(numeric - analytic) / std::max(std::abs(numeric), 1e-3);
      if (error > worst) worst = error, worst_name = str_cat(name, " (", loss_names[loss_idx], ")");
      if (error > 1e-2)
        std::printf("  %-60s %s: analytic %.6e numeric %.6e\n", name.c_str(), loss_names[loss_idx], analytic, numeric);
      ++checked;
    }
  }
  std::printf("  worst directional-derivative rel error %.3e (%s) over %d checks\n", worst, worst_name.c_str(),
              checked);
  EXPECT_LT(worst, 1e-2);
}

TEST(TextModel, ForwardBackwardOf64TokensTakesUnderASecond) {
  const TextConfig config = tiny_config();
  const ParamMap params = random_text_params(config, kPrefix, 27);
  const int64_t T = 64;
  Rng rng(28);
  const std::vector<int64_t> ids = random_ids(rng, T, config.vocab_size);
  std::vector<int64_t> labels = random_ids(rng, T, config.vocab_size), shifted(T);
  shift_labels_ref(labels.data(), shifted.data(), 1, T);
  TextModel model(config, kPrefix, &params);
  const auto start = std::chrono::steady_clock::now();
  model.forward(make_text_batch(config, T, {0, 64}), {ids.data(), nullptr, shifted.data()});
  const ParamMap grads = model.backward(1.0f, 0.0f);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("  forward + backward of %lld tokens: %.3f s\n", static_cast<long long>(T), seconds);
  EXPECT_LT(seconds, 1.0);
}

}  // namespace
}  // namespace deltamoe
