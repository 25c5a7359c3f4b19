// GpuTextModel against the CPU reference TextModel (fp32) on the tiny config: same bf16-rounded
// weights, same tokens, the CPU's routing pinned to the GPU's choice (near-ties in bf16 would
// otherwise pick other experts); loss, aux loss and every parameter gradient compared, for the
// whole model and for each decoder layer alone (fed the GPU's own layer input and gradient); and
// the multimodal input (image-token rows) against the CPU model started from input_embeds. The
// cases run the tiny preset and text_8layer's architecture.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "core/cuda_check.h"
#include "core/dtype.h"
#include "kernels/common/tensor_compare.h"
#include "kernels/embedding/embedding.h"
#include "kernels/moe_aux_loss/moe_aux_loss.h"
#include "model/config.h"
#include "model/text/decoder.h"
#include "model/text/text_batch.h"
#include "model/text/text_model.h"
#include "model/gpu/device_params.h"
#include "model/param_table.h"
#include "model/text/gpu/gpu_text_model.h"
#include "model/text/text_weights.h"

namespace deltamoe {
namespace {

// Honest bounds. The GPU rounds products and every activation to bf16; the CPU keeps fp32. How
// far that may move a result depends on the model's conditioning, so the test measures it: the
// CPU reference is rerun with every weight scaled by (1 + u 2^-9), u uniform in [-1, 1] (about one
// bf16 rounding per weight), same routing, for two draws; each tensor may differ from the CPU by
// a factor (kSensitivityFactor for one layer alone, kWholeModelFactor for the whole model) x the
// larger move of the two, and at least a floor. A composition bug (a
// missing term, a wrong buffer, a wrong scale) moves a tensor by O(1), far beyond either.
// Why (measured on the CPU with that perturbation, whole model): at matrix std 0.15 the tiny model
// is chaotic: the perturbation alone moves layer-0 gradients 30% and A_log/dt_bias ~150%, the
// sizes the H200 run showed (GPU error / one-draw sensitivity: median 1.4, max 4.0 over 80
// tensors). At std 0.05 it moves activations <0.8% and packed-case gradients <3%.
constexpr double kMatrixStd = 0.05;
constexpr float kWeightPerturbation = 1.0f / 512.0f;
constexpr double kSensitivityFactor = 4.0;
// The whole model stacks L layers of ~10 bf16 activation roundings each, and the perturbation
// above stands for about one of them: a weight perturbation averages over each product's fan-in,
// an activation rounding does not. If each rounding moves a result about as much as the
// perturbation and they are uncorrelated, the GPU's error is ~sqrt(10 L) = 6.3x the measured move
// for L = 4, hence a factor of 8 for whole-model comparisons. The one-token batch shows it (H200,
// 2026-12-02: GPU error / sensitivity up to 5.3, since no sum over tokens averages the noise);
// packed batches stayed under 4. A composition bug still moves a tensor by O(1), and the
// layer-alone checks keep factor 4 and the 3e-2 floor.
constexpr double kWholeModelFactor = 8.0;
constexpr double kActivationFloor = 1e-2;  // bf16 read-out alone is ~2e-3
constexpr double kGradFloor = 2e-2;
constexpr double kLossRel = 1e-2;
// One decoder layer alone (CPU fed the GPU's own layer input and output gradient): one layer of
// roundings, ~10 bf16 ops of <=4e-3 each, so a 3e-2 floor.
constexpr double kLayerFloor = 3e-2;

// A single-token batch scales every floor and factor by this. Nothing averages over tokens there:
// one token's d_topk_weight or gate gradient carries its bf16 noise undamped, and two weight draws
// estimate that token's sensitivity poorly. Measured by rerunning the cases on 16 weight draws
// (DELTAMOE_TEST_WEIGHT_SEED): with the fp32-exact router and fp32 GDN operands the worst
// single-token ratio at scale 2 was 0.94 (H200); with the GDN products on bf16 operands
// (gated_delta_rule_notes.md) layer 1's router weight gradient alone reached 1.21 at scale 2 on one
// draw (H100, 2026-12-05), and at scale 3 the worst over the 16 draws is 0.83. The packed cases
// stayed at or under 0.94 at scale 1. A composition bug still moves a tensor by O(1).
constexpr double kSingleTokenBoundScale = 3.0;
// No bound exceeds this relative L2 error, whatever the sensitivity says: a sign-flipped or zeroed
// tensor (rel_l2 >= 1) always fails, and so does any error of that size.
constexpr double kMaxBound = 0.3;

// Where rel_l2 cannot judge: the GPU's roundings are expected to move a whole-model result up to
// ~kWholeModelFactor times its bf16-weight sensitivity (above). Once that product reaches 1, the
// size of a zeroed tensor, the comparison cannot tell rounding noise from a wrong result. Seen
// only on rank-1 gate gradients (one token's d_logit times its input, d_logit a cancelling dot
// product): a one-ulp weight perturbation alone moved layer 3's shared-expert gate gradient by 20%
// on one of 16 draws. Such a layer tensor is printed, not asserted, in the whole-model comparison;
// its layer-alone check in the same case, where one layer's roundings act, still asserts it. The
// exemption reads only the CPU runs, so no GPU result can earn it, and a case may exempt at most
// kMaxNoiseDominatedShare of its gradients.
constexpr double kMaxNoiseDominatedShare = 0.05;

double bound_from(double sensitivity, double floor, double factor) {
  return std::min(kMaxBound, std::max(floor, factor * sensitivity));
}

double rel_l2_of(const std::vector<float>& got, const std::vector<float>& ref) {
  return compare_values(got.data(), ref.data(), static_cast<int64_t>(std::min(got.size(), ref.size()))).rel_l2;
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The weights' random seed: 7, or DELTAMOE_TEST_WEIGHT_SEED to rerun the cases on other draws
// (how far the bf16 error / bound ratios spread over draws: docs/vision.md, "The fp32-exact MoE router",
// "Single-token bounds").
uint64_t weight_seed() {
  const char* text = std::getenv("DELTAMOE_TEST_WEIGHT_SEED");
  return text != nullptr ? std::strtoull(text, nullptr, 10) : 7;
}

// Rounds every weight to bf16 (the GPU's working copy) except the fp32 GDN gate parameters.
ParamMap rounded_params(const TextConfig& config) {
  ParamMap params = random_text_params(config, "model", weight_seed(), kMatrixStd);
  for (auto& [name, tensor] : params) {
    if (ends_with(name, "A_log") || ends_with(name, "dt_bias")) continue;
    for (float& v : tensor.values) v = round_to_bf16(v);
  }
  return params;
}

// The weights scaled by (1 + u 2^-9), u uniform in [-1, 1], fixed seed: see kWeightPerturbation.
ParamMap perturbed_params(const ParamMap& params, uint32_t seed) {
  ParamMap out = params;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (auto& [name, tensor] : out)
    for (float& v : tensor.values) v *= 1.0f + kWeightPerturbation * unit(rng);
  return out;
}

// Prints and checks one GPU tensor against the CPU reference; the bound is the floor or
// kSensitivityFactor times how far the perturbed-weight CPU run moved the same tensor. With
// noise_factor > 0, a tensor whose noise_factor x sensitivity reaches 1 is printed as
// noise-dominated and not held to a bound (kMaxNoiseDominatedShare says why): returns -1 then,
// else rel_l2 / bound.
double check_tensor(const std::string& label, const std::vector<float>& got, const std::vector<float>& ref,
                    const std::vector<float>& perturbed_ref, const std::vector<float>& perturbed_ref2, double floor,
                    double factor = kWholeModelFactor, double noise_factor = 0.0) {
  EXPECT_EQ(got.size(), ref.size()) << label;
  const CompareResult r =
      compare_values(got.data(), ref.data(), static_cast<int64_t>(std::min(got.size(), ref.size())));
  const double sensitivity = std::max(rel_l2_of(perturbed_ref, ref), rel_l2_of(perturbed_ref2, ref));
  EXPECT_TRUE(r.all_finite) << label;
  if (noise_factor > 0.0 && noise_factor * sensitivity >= 1.0) {
    std::printf("    %-52s max|diff| %.3e max|ref| %.3e rel_l2 %.3e (bf16-weight sensitivity %.2e: noise-dominated, "
                "judged alone)%s\n",
                label.c_str(), r.max_abs_diff, r.max_abs_ref, r.rel_l2, sensitivity, r.all_finite ? "" : " NOT FINITE");
    return -1.0;
  }
  const double bound = bound_from(sensitivity, floor, factor);
  std::printf("    %-52s max|diff| %.3e max|ref| %.3e rel_l2 %.3e (bf16-weight sensitivity %.2e, bound %.2e)%s\n",
              label.c_str(), r.max_abs_diff, r.max_abs_ref, r.rel_l2, sensitivity, bound,
              r.all_finite ? "" : " NOT FINITE");
  EXPECT_LE(r.rel_l2, bound) << label;
  return r.rel_l2 / bound;
}

// The tiny text model on the GPU: every parameter trained (master, gradients) in DeviceParams, the
// model bound to it, on its own stream.
struct GpuUnderTest {
  cudaStream_t stream = nullptr;
  std::unique_ptr<DeviceParams> params;
  std::unique_ptr<GpuTextModel> model;
  GpuUnderTest(const TextConfig& config, const ParamMap& values, const GpuModelOptions& options) {
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const std::set<std::string> read_in_f32 = text_params_read_in_f32(config, "model");
    std::vector<DeviceParamSpec> specs;
    for (const ParamSpec& p : text_param_table(config, "model", true))
      specs.push_back({p.name, p.shape.to_vector(), true, read_in_f32.count(p.name) != 0, p.init, 0.02});
    params = std::make_unique<DeviceParams>(specs);
    for (const auto& [name, tensor] : values)
      params->upload(name, 0, static_cast<int64_t>(tensor.values.size()), tensor.values.data(), DType::f32);
    model = std::make_unique<GpuTextModel>(config, bind_text_weights(config, "model", params->lookup()), options,
                                           stream);
  }
  ~GpuUnderTest() {
    model.reset();
    cudaStreamDestroy(stream);
  }
  std::vector<float> read_gradient(const std::string& name) const {
    CUDA_CHECK(cudaStreamSynchronize(stream));
    return params->read_gradient(name);
  }
  const std::vector<ParamEntry>& entries() const { return params->trained_layout().entries(); }
};

ParamMap zero_grads_like(const ParamMap& params) {
  ParamMap grads;
  for (const auto& [name, tensor] : params) {
    ParamTensor zero = tensor;
    std::fill(zero.values.begin(), zero.values.end(), 0.0f);
    grads.emplace(name, std::move(zero));
  }
  return grads;
}

// One CPU decoder layer, forward then backward, on given inputs.
struct CpuLayerRun {
  DecoderLayerSaved saved;
  Activation y, dx;
  ParamMap grads;
};

CpuLayerRun run_cpu_layer(const TextConfig& config, const ParamMap& params, int64_t layer, const TextBatch& batch,
                          const Activation& x, const int32_t* routing, const Activation& dy, const MoeAuxStats& stats,
                          float aux_weight) {
  CpuLayerRun run;
  run.y = decoder_layer_forward(config, params, layer, "model", batch, x, &run.saved, nullptr, routing);
  run.grads = zero_grads_like(params);
  run.dx = decoder_layer_backward(config, params, &run.grads, layer, "model", batch, run.saved, dy, stats, aux_weight);
  return run;
}

// Each decoder layer in isolation: the CPU layer gets the GPU's bf16 layer input, routing and
// captured output gradient (and the GPU's aux statistics), so errors do not compound across
// layers and a wrong op shows up in the layer (and the parameter) where it happens.
void check_layers_in_isolation(const TextConfig& config, const ParamMap& params, const ParamMap& perturbed,
                               const ParamMap& perturbed2,
                               const TextBatch& batch, const GpuUnderTest& under_test,
                               const std::vector<std::vector<int32_t>>& routing, float aux_weight, double scale) {
  const double floor = kLayerFloor * scale, factor = kSensitivityFactor * scale;
  const GpuTextModel& gpu = *under_test.model;
  const int64_t T = batch.num_tokens, E = config.num_experts, K = config.num_experts_per_tok;
  MoeAuxStats stats;
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    const std::vector<float> probs = gpu.read_layer_activation(i, LayerActivation::router_probs);
    moe_aux_loss_accumulate_ref(probs.data(), routing[static_cast<size_t>(i)].data(), T, E, K, &stats);
  }
  double worst = 0.0;
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    std::printf("  layer %lld alone (CPU fed the GPU's layer input and output gradient)\n", static_cast<long long>(i));
    const Activation x = gpu.read_layer_activation(i, LayerActivation::input);
    const Activation dy = gpu.read_layer_gradient(i, LayerGradient::output);
    const int32_t* route = routing[static_cast<size_t>(i)].data();
    const CpuLayerRun ref = run_cpu_layer(config, params, i, batch, x, route, dy, stats, aux_weight);
    const CpuLayerRun moved = run_cpu_layer(config, perturbed, i, batch, x, route, dy, stats, aux_weight);
    const CpuLayerRun moved2 = run_cpu_layer(config, perturbed2, i, batch, x, route, dy, stats, aux_weight);
    worst = std::max(worst, check_tensor("forward: after mixer (h)", gpu.read_layer_activation(i, LayerActivation::after_mixer),
                                         ref.saved.h, moved.saved.h, moved2.saved.h, floor, factor));
    worst = std::max(worst, check_tensor("forward: moe input", gpu.read_layer_activation(i, LayerActivation::moe_input),
                                         ref.saved.moe.x, moved.saved.moe.x, moved2.saved.moe.x, floor,
                                         factor));
    if (i + 1 < config.num_hidden_layers)
      worst = std::max(worst, check_tensor("forward: layer output", gpu.read_layer_activation(i + 1, LayerActivation::input),
                                           ref.y, moved.y, moved2.y, floor, factor));
    worst = std::max(worst, check_tensor("backward: d layer input", gpu.read_layer_gradient(i, LayerGradient::input),
                                         ref.dx, moved.dx, moved2.dx, floor, factor));
    const std::string names = layer_prefix("model", i);
    for (const ParamEntry& entry : under_test.entries()) {
      if (entry.name.compare(0, names.size(), names) != 0) continue;
      worst = std::max(worst, check_tensor(entry.name, under_test.read_gradient(entry.name), ref.grads.at(entry.name).values,
                                           moved.grads.at(entry.name).values, moved2.grads.at(entry.name).values,
                                           floor, factor));
    }
  }
  std::printf("  layers alone: worst rel_l2 / bound %.3f\n", worst);
}

struct CpuModelRun {
  TextModelOutput out;
  ParamMap grads;
  std::vector<DecoderLayerSaved> saved;
};

CpuModelRun run_cpu_model(const TextConfig& config, const ParamMap& params, const TextBatch& batch,
                          const TextModelInputs& inputs, float aux_weight) {
  CpuModelRun run;
  TextModel cpu(config, "model", &params);
  run.out = cpu.forward(batch, inputs);
  run.grads = cpu.backward(1.0f, aux_weight);
  run.saved = cpu.saved_layers();
  return run;
}

// `depth_scale` widens only the whole-model factor, for a model deeper than tiny's 4 layers (see
// kWholeModelFactor: the noise grows as sqrt(layers)); the per-layer checks keep their bounds.
void run_case(const char* title, const std::vector<int32_t>& cu_seqlens, float aux_weight, bool recompute = false,
              double scale = 1.0, const TextConfig& config = model_config_preset("tiny").text,
              double depth_scale = 1.0) {
  std::printf("%s\n", title);
  const int64_t T = cu_seqlens.back();
  const ParamMap params = rounded_params(config);
  const ParamMap perturbed = perturbed_params(params, 12345);
  const ParamMap perturbed2 = perturbed_params(params, 67890);
  std::vector<int64_t> ids(static_cast<size_t>(T)), labels(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) ids[t] = (t * 7919 + 13) % config.vocab_size;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s)
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t)
      labels[t] = t + 1 < cu_seqlens[s + 1] ? ids[t + 1] : -100;
  if (T > 3) labels[2] = -100;  // an ignored label inside a sequence
  if (T == 1) labels[0] = 5;     // a lone token still gets a label, so the loss has a gradient

  GpuModelOptions options;
  options.max_tokens = T + 5;  // planned above the batch: buffers are used partly
  options.max_seqs = static_cast<int64_t>(cu_seqlens.size());
  options.loss_chunk_rows = 16;  // several lm_head chunks, the last one partial
  options.aux_loss_weight = aux_weight;
  options.recompute_mixers = recompute;
  options.capture_layer_grads = true;
  GpuUnderTest under_test(config, params, options);
  GpuTextModel& gpu = *under_test.model;
  gpu.set_batch(ids, labels, cu_seqlens);
  gpu.forward_backward();
  const float gpu_loss = gpu.read_loss();
  const double gpu_aux = gpu.read_aux_loss();
  std::vector<std::vector<int32_t>> routing;
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) routing.push_back(gpu.read_topk_idx(i));

  const TextBatch batch = make_text_batch(config, T, cu_seqlens);
  TextModelInputs inputs;
  inputs.input_ids = ids.data();
  inputs.shifted_labels = labels.data();
  inputs.forced_routing = &routing;
  const CpuModelRun ref = run_cpu_model(config, params, batch, inputs, aux_weight);
  const CpuModelRun moved = run_cpu_model(config, perturbed, batch, inputs, aux_weight);
  const CpuModelRun moved2 = run_cpu_model(config, perturbed2, batch, inputs, aux_weight);

  // Forward, layer by layer: where a composition goes wrong shows up here first.
  std::printf("  whole model, forward\n");
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    const DecoderLayerSaved& r = ref.saved[static_cast<size_t>(i)];
    const DecoderLayerSaved& m = moved.saved[static_cast<size_t>(i)];
    const DecoderLayerSaved& m2 = moved2.saved[static_cast<size_t>(i)];
    const std::string layer = "layer " + std::to_string(i) + (r.type == LayerType::linear_attention ? " (GDN) " : " (attention) ");
    const double floor = kActivationFloor * scale, factor = kWholeModelFactor * scale * depth_scale;
    check_tensor(layer + "input", gpu.read_layer_activation(i, LayerActivation::input), r.x, m.x, m2.x, floor, factor);
    check_tensor(layer + "after mixer", gpu.read_layer_activation(i, LayerActivation::after_mixer), r.h, m.h, m2.h,
                 floor, factor);
    check_tensor(layer + "moe input", gpu.read_layer_activation(i, LayerActivation::moe_input), r.moe.x, m.moe.x,
                 m2.moe.x, floor, factor);
    check_tensor(layer + "router probs", gpu.read_layer_activation(i, LayerActivation::router_probs), r.moe.probs,
                 m.moe.probs, m2.moe.probs, floor, factor);
  }

  const double loss_rel = std::fabs(gpu_loss - ref.out.ce_loss) / std::max(std::fabs(ref.out.ce_loss), 1e-12);
  const double aux_rel = std::fabs(gpu_aux - ref.out.aux_loss) / std::max(std::fabs(ref.out.aux_loss), 1e-12);
  EXPECT_GT(ref.out.num_supervised, 0);
  std::printf("  ce loss gpu %.6f cpu %.6f rel %.3e; aux gpu %.6f cpu %.6f rel %.3e\n", gpu_loss, ref.out.ce_loss,
              loss_rel, gpu_aux, ref.out.aux_loss, aux_rel);
  EXPECT_TRUE(std::isfinite(gpu_loss));
  EXPECT_LE(loss_rel, kLossRel);
  EXPECT_LE(aux_rel, kLossRel);
  std::printf("  whole model, parameter gradients\n");
  double worst = 0.0;
  int noise_dominated = 0;
  const std::string layer_names = "model.layers.";  // the tensors a layer-alone check below also judges
  for (const ParamEntry& entry : under_test.entries()) {
    const bool judged_alone = entry.name.compare(0, layer_names.size(), layer_names) == 0;
    const double ratio =
        check_tensor(entry.name, under_test.read_gradient(entry.name), ref.grads.at(entry.name).values,
                     moved.grads.at(entry.name).values, moved2.grads.at(entry.name).values, kGradFloor * scale,
                     kWholeModelFactor * scale * depth_scale, judged_alone ? kWholeModelFactor * depth_scale : 0.0);
    if (ratio < 0.0) ++noise_dominated;
    worst = std::max(worst, ratio);
  }
  std::printf("  whole model: worst gradient rel_l2 / bound %.3f; %d noise-dominated, judged alone\n", worst,
              noise_dominated);
  EXPECT_LE(noise_dominated, kMaxNoiseDominatedShare * static_cast<double>(under_test.entries().size()))
      << "too many gradients too ill-conditioned in this case for rel_l2 to judge";
  check_layers_in_isolation(config, params, perturbed, perturbed2, batch, under_test, routing, aux_weight, scale);
}

TEST(GpuTextModel, PackedShortSequencesMatchCpuReference) {
  // A one-token sequence, sequences shorter and longer than the GDN chunk (64), 150 tokens.
  run_case("packed: lengths 1, 5, 70, 74", {0, 1, 6, 76, 150}, 0.01f);
}

TEST(GpuTextModel, TwoRowsNoAuxLossMatchCpuReference) { run_case("two rows of 64, aux weight 0", {0, 64, 128}, 0.0f); }

TEST(GpuTextModel, RecomputedMixersMatchCpuReference) {
  // The GDN layers share one set of mixer intermediates, refilled by a forward rerun before each
  // backward; the per-layer checks read per-layer buffers (input, h, MoE input, probs), still valid.
  run_case("packed with mixer recomputation: lengths 3, 97", {0, 3, 100}, 0.01f, true);
}

TEST(GpuTextModel, SingleTokenBatch) {
  run_case("one token (bounds x3: kSingleTokenBoundScale)", {0, 1}, 0.01f, false, kSingleTokenBoundScale);
}

// text_8layer's architecture (tests/golden/text_8layer/model/config.json: 6 GDN and 2 attention
// layers) with this test's well-conditioned weights. The golden case's own weights make every ce
// gradient chaotic, so gpu_parity_golden_gpu_test only prints them; here every gradient of every
// layer is asserted within a bound of at most kMaxBound, so a wrong GPU gradient on that model
// fails. Whole-model factor x sqrt(2) for twice tiny's depth.
TEST(GpuTextModel, Text8LayerArchitectureMatchesCpuReference) {
  const char* source = std::getenv("DELTAMOE_SOURCE_DIR");
  const std::string file =
      std::string(source != nullptr ? source : ".") + "/tests/golden/text_8layer/model/config.json";
  const TextConfig config = load_model_config_file(file).text;
  ASSERT_EQ(config.num_hidden_layers, 8) << file;
  run_case("text_8layer architecture: lengths 5, 70, 33", {0, 5, 75, 108}, 0.01f, false, 1.0, config, std::sqrt(2.0));
}

// The multimodal input: image embeddings written into image_embeddings() replace the embedding of
// the image-token rows (3-D positions that differ per axis there); the backward hands those rows'
// gradient to image_embedding_grads() and keeps it out of embed_tokens. The CPU model starts from
// the same input_embeds; its d_input_embeds at those rows is the reference, and embed_tokens'
// gradient is the lookup's backward with those rows zeroed (multimodal_embed_backward).
struct CpuEmbedsRun {
  TextModelOutput out;
  ParamMap grads;
  std::vector<float> embeds;    // [T, C] the model's input (lookup with the image rows replaced)
  std::vector<float> d_embeds;  // [T, C]
};

CpuEmbedsRun run_cpu_from_embeds(const TextConfig& config, const ParamMap& params, const TextBatch& batch,
                                 const std::vector<int64_t>& ids, const std::vector<int64_t>& labels,
                                 const std::vector<int32_t>& rows, const std::vector<float>& image_embeds,
                                 const std::vector<std::vector<int32_t>>& routing) {
  const int64_t T = batch.num_tokens, C = config.hidden_size;
  const std::string table = "model.embed_tokens.weight";
  CpuEmbedsRun run;
  std::vector<float>& embeds = run.embeds;
  embeds.resize(static_cast<size_t>(T * C));
  embedding_forward_ref(ids.data(), param_values(params, table), embeds.data(), T, config.vocab_size, C);
  for (size_t i = 0; i < rows.size(); ++i)
    std::copy_n(image_embeds.data() + i * C, C, embeds.data() + rows[i] * C);
  TextModelInputs inputs;
  inputs.input_ids = ids.data();
  inputs.input_embeds = embeds.data();
  inputs.shifted_labels = labels.data();
  inputs.forced_routing = &routing;
  TextModel cpu(config, "model", &params);
  run.out = cpu.forward(batch, inputs);
  run.grads = cpu.backward(1.0f, 0.01f, &run.d_embeds);
  std::vector<float> d_lookup = run.d_embeds;
  for (int32_t row : rows) std::fill_n(d_lookup.data() + row * C, C, 0.0f);
  embedding_backward_ref(ids.data(), d_lookup.data(), param_values(run.grads, table), T, config.vocab_size, C);
  return run;
}

std::vector<float> rows_of(const std::vector<float>& matrix, const std::vector<int32_t>& rows, int64_t width) {
  std::vector<float> out;
  for (int32_t row : rows) out.insert(out.end(), matrix.begin() + row * width, matrix.begin() + (row + 1) * width);
  return out;
}

TEST(GpuTextModel, ImageRowsMatchCpuInputEmbeds) {
  std::printf("image rows: 2 sequences (25 + 15 tokens), 6 image-token rows\n");
  const TextConfig config = model_config_preset("tiny").text;
  const int64_t C = config.hidden_size, image_id = 4000;
  const std::vector<int32_t> cu_seqlens = {0, 25, 40};
  const std::vector<int32_t> rows = {3, 4, 5, 6, 30, 31};
  const int64_t T = cu_seqlens.back(), M = static_cast<int64_t>(rows.size());
  const ParamMap params = rounded_params(config);
  const ParamMap perturbed = perturbed_params(params, 12345);
  const ParamMap perturbed2 = perturbed_params(params, 67890);
  std::vector<int64_t> ids(static_cast<size_t>(T)), labels(static_cast<size_t>(T), -100);
  for (int64_t t = 0; t < T; ++t) ids[t] = (t * 7919 + 13) % 3000;
  for (int32_t row : rows) ids[row] = image_id;
  for (int64_t t = 0; t + 1 < T; ++t)
    if (t + 1 != cu_seqlens[1] && ids[t + 1] != image_id) labels[t] = ids[t + 1];
  // 3-D positions: text counts on every axis; the image tokens spread over (h, w) as a 2 x 2 grid.
  std::vector<int64_t> positions(static_cast<size_t>(3 * T));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = t < cu_seqlens[1] ? t : t - cu_seqlens[1];
    const auto image = std::find(rows.begin(), rows.end(), static_cast<int32_t>(t));
    const int64_t k = image != rows.end() ? (image - rows.begin()) % 4 : 0;
    positions[t] = p;
    positions[T + t] = p + (image != rows.end() ? k / 2 + 3 : 0);
    positions[2 * T + t] = p + (image != rows.end() ? k % 2 + 5 : 0);
  }
  std::vector<float> image_embeds(static_cast<size_t>(M * C));
  const HostTensor random = random_normal_tensor(Shape{M, C}, 99, static_cast<float>(kMatrixStd));
  for (int64_t i = 0; i < M * C; ++i) image_embeds[i] = round_to_bf16(random.as<float>()[i]);

  GpuModelOptions options;
  options.max_tokens = T + 3;
  options.max_seqs = 2;
  options.max_image_rows = M + 2;
  options.aux_loss_weight = 0.01f;
  GpuUnderTest under_test(config, params, options);
  GpuTextModel& gpu = *under_test.model;
  EXPECT_THROW(gpu.set_image_rows({5, 4}), Error);                         // not increasing
  EXPECT_THROW(gpu.set_image_rows(std::vector<int32_t>(M + 3, 0)), Error);  // over max_image_rows
  gpu.set_image_rows(rows);
  gpu.set_batch(ids, labels, cu_seqlens, positions);
  std::vector<uint16_t> bits(image_embeds.size());
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = float_to_bf16_bits(image_embeds[i]);
  CUDA_CHECK(cudaStreamSynchronize(under_test.stream));
  CUDA_CHECK(cudaMemcpy(gpu.image_embeddings(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
  gpu.forward_backward();
  const float gpu_loss = gpu.read_loss();
  std::vector<std::vector<int32_t>> routing;
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) routing.push_back(gpu.read_topk_idx(i));
  std::fill(bits.begin(), bits.end(), uint16_t{0xFFFF});
  CUDA_CHECK(cudaMemcpy(bits.data(), gpu.image_embedding_grads(), bits.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<float> gpu_image_grads(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) gpu_image_grads[i] = bf16_bits_to_float(bits[i]);

  const TextBatch batch = make_text_batch(config, T, cu_seqlens, positions);
  const CpuEmbedsRun ref = run_cpu_from_embeds(config, params, batch, ids, labels, rows, image_embeds, routing);
  const CpuEmbedsRun moved = run_cpu_from_embeds(config, perturbed, batch, ids, labels, rows, image_embeds, routing);
  const CpuEmbedsRun moved2 = run_cpu_from_embeds(config, perturbed2, batch, ids, labels, rows, image_embeds, routing);
  const double loss_rel = std::fabs(gpu_loss - ref.out.ce_loss) / std::max(std::fabs(ref.out.ce_loss), 1e-12);
  std::printf("  ce loss gpu %.6f cpu %.6f rel %.3e\n", gpu_loss, ref.out.ce_loss, loss_rel);
  EXPECT_LE(loss_rel, kLossRel);
  // bf16 table rows and bf16 image rows are copied, not computed: the layer input matches exactly.
  const std::vector<float> layer_input = gpu.read_layer_activation(0, LayerActivation::input);
  const CompareResult input = compare_values(layer_input.data(), ref.embeds.data(), T * C);
  std::printf("  layer 0 input (lookup + image rows): max|diff| %.3e max|ref| %.3e\n", input.max_abs_diff,
              input.max_abs_ref);
  EXPECT_EQ(input.max_abs_diff, 0.0);
  EXPECT_TRUE(input.all_finite);
  check_tensor("image_embedding_grads", gpu_image_grads, rows_of(ref.d_embeds, rows, C),
               rows_of(moved.d_embeds, rows, C), rows_of(moved2.d_embeds, rows, C), kGradFloor);
  const std::string table = "model.embed_tokens.weight";
  check_tensor(table, under_test.read_gradient(table), ref.grads.at(table).values, moved.grads.at(table).values,
               moved2.grads.at(table).values, kGradFloor);
  // The image token's own table row gets nothing: all its rows were image rows.
  const std::vector<float> table_grad = under_test.read_gradient(table);
  const bool image_row_zero = std::all_of(table_grad.begin() + image_id * C, table_grad.begin() + (image_id + 1) * C,
                                          [](float v) { return v == 0.0f; });
  EXPECT_TRUE(image_row_zero) << "the <|image_pad|> row of embed_tokens received a gradient";
  for (const char* name : {"model.layers.3.self_attn.q_proj.weight", "model.layers.0.linear_attn.in_proj_qkv.weight"})
    check_tensor(name, under_test.read_gradient(name), ref.grads.at(name).values, moved.grads.at(name).values,
                 moved2.grads.at(name).values, kGradFloor);
}

TEST(GpuTextModel, BadBatchIsRejectedWithAMessage) {
  const TextConfig config = model_config_preset("tiny").text;
  GpuModelOptions options;
  options.max_tokens = 16;
  options.max_seqs = 2;
  GpuUnderTest under_test(config, random_text_params(config, "model", 1, kMatrixStd), options);
  GpuTextModel& gpu = *under_test.model;
  std::vector<int64_t> ids(32, 1), labels(32, -100);
  EXPECT_THROW(gpu.set_batch(ids, labels, {0, 32}), Error);  // over the token budget
  ids.resize(8);
  labels.resize(8);
  EXPECT_THROW(gpu.set_batch(ids, labels, {0, 4, 7}), Error);  // cu_seqlens does not end at T
  ids[3] = config.vocab_size;
  EXPECT_THROW(gpu.set_batch(ids, labels, {0, 8}), Error);  // token id outside the vocabulary
}


// Full recompute (GpuModelOptions::recompute_layers) reruns a layer's forward from its kept fp32
// input with the same kernels on the same values, so the loss, the aux loss and every gradient are
// bitwise those of the run that kept everything: all layers, only the first, all but the last, and
// full + selective together; and so are runs that keep the experts' gate/up rows and the GDN forward
// for the backward (TextActivationSpec's keep flags) under those modes. Our attention kernel is forced (cuDNN's dQ accumulates with atomics,
// so two runs differ in the last bits whatever is recomputed). aux weight > 0: a rerun must not add
// its layer to the aux statistics twice.
TEST(GpuTextModel, RecomputedLayersAreBitwiseTheKeptOnes) {
  setenv("DELTAMOE_ATTENTION", "ours", 1);
  const char* source = std::getenv("DELTAMOE_SOURCE_DIR");
  const std::string file =
      std::string(source != nullptr ? source : ".") + "/tests/golden/text_8layer/model/config.json";
  const TextConfig config = load_model_config_file(file).text;
  const ParamMap params = rounded_params(config);
  const std::vector<int32_t> cu_seqlens = {0, 3, 70, 160};
  const int64_t T = cu_seqlens.back();
  std::vector<int64_t> ids(static_cast<size_t>(T)), labels(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) ids[t] = (t * 7919 + 13) % config.vocab_size;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s)
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t)
      labels[t] = t + 1 < cu_seqlens[s + 1] ? ids[t + 1] : -100;
  struct Run {
    float loss = 0;
    double aux = 0;
    std::vector<std::vector<float>> grads;
    size_t activation_bytes = 0;
  };
  auto run = [&](int64_t recompute_layers, bool recompute_mixers, bool keep = false) {
    GpuModelOptions options;
    options.max_tokens = T + 5;
    options.max_seqs = static_cast<int64_t>(cu_seqlens.size());
    options.loss_chunk_rows = 16;
    options.aux_loss_weight = 0.01f;
    options.recompute_layers = recompute_layers;
    options.recompute_mixers = recompute_mixers;
    options.keep_expert_rows = keep;
    options.keep_gdn_forward = keep;
    GpuUnderTest under_test(config, params, options);
    under_test.model->set_batch(ids, labels, cu_seqlens);
    under_test.model->forward_backward();
    Run out;
    out.activation_bytes = under_test.model->bytes().activations;
    out.loss = under_test.model->read_loss();
    out.aux = under_test.model->read_aux_loss();
    for (const ParamEntry& entry : under_test.entries()) out.grads.push_back(under_test.read_gradient(entry.name));
    return out;
  };
  const Run kept = run(0, false);
  ASSERT_TRUE(std::isfinite(kept.loss));
  ASSERT_GT(kept.aux, 0.0);
  const int64_t L = config.num_hidden_layers;
  // And with the experts' gate/up rows and the GDN forward kept for the backward (nothing
  // recomputed, partly, or mixers rerun into the shared sets): still the same bits.
  for (const auto& [layers, mixers, keep] : std::vector<std::tuple<int64_t, bool, bool>>{
           {L, false, false}, {1, false, false}, {L - 1, false, false}, {3, true, false}, {0, false, true},
           {2, false, true}, {0, true, true}, {L, false, true}}) {
    const Run rerun = run(layers, mixers, keep);
    std::printf("  recompute %lld of %lld layers%s%s: loss %.9g (kept %.9g), aux %.12g (kept %.12g)\n",
                static_cast<long long>(layers), static_cast<long long>(L), mixers ? " + mixers" : "",
                keep ? ", expert rows and GDN forward kept" : "", rerun.loss, kept.loss, rerun.aux, kept.aux);
    EXPECT_EQ(rerun.loss, kept.loss);
    EXPECT_EQ(rerun.aux, kept.aux);
    // The kept intermediates take memory of their own (the kernel tests show they are read).
    if (keep) {
      EXPECT_GT(rerun.activation_bytes, run(layers, mixers, false).activation_bytes);
    }
    ASSERT_EQ(rerun.grads.size(), kept.grads.size());
    size_t differing = 0;
    for (size_t i = 0; i < kept.grads.size(); ++i) {
      ASSERT_EQ(rerun.grads[i].size(), kept.grads[i].size());
      if (std::memcmp(rerun.grads[i].data(), kept.grads[i].data(), kept.grads[i].size() * sizeof(float)) != 0) ++differing;
    }
    EXPECT_EQ(differing, 0u) << "gradients not bitwise equal with " << layers << " recomputed layers";
  }
}

}  // namespace
}  // namespace deltamoe
