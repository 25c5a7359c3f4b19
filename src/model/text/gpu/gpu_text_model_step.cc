// GpuTextModel's forward and backward schedules, following the CPU reference model
// (src/model/text: decoder.cc, gdn_layer.cc, attention_layer.cc, moe_block.cc, text_model.cc)
// operation for operation; residual adds are fused into the following RMSNorm. Precision follows
// transformers' bf16 autocast with fp32 parameters: bf16 GEMM operands, an fp32 residual stream
// and stream gradient, norm weights and the embedding read in fp32. Frozen weights (null gradient
// views) skip their weight-gradient work. One stream, no allocation, no host synchronisation but,
// with expert parallelism, the exchange plan's one wait per MoE layer (gpu_expert_parallel.h).
#include <cmath>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/attention/attention_cuda.h"
#include "kernels/cudnn_sdpa/gpu/cudnn_sdpa.h"
#include "kernels/causal_conv1d/causal_conv1d_cuda.h"
#include "kernels/cross_entropy/cross_entropy_cuda.h"
#include "kernels/embedding/embedding_cuda.h"
#include "kernels/gate_activations/gate_activations_cuda.h"
#include "kernels/gated_delta_rule/gated_delta_rule_cuda.h"
#include "kernels/gated_rmsnorm/gated_rmsnorm_cuda.h"
#include "kernels/gdn_gates/gdn_gates_cuda.h"
#include "kernels/gemm/f32_operand_cuda.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/l2norm/l2norm_cuda.h"
#include "kernels/lora/lora_cuda.h"
#include "kernels/moe_aux_loss/moe_aux_loss_cuda.h"
#include "kernels/moe_experts/moe_experts_cuda.h"
#include "model/text/gpu/gpu_expert_parallel.h"
#include "kernels/moe_router/moe_router_cuda.h"
#include "kernels/mrope/mrope_cuda.h"
#include "kernels/rms_norm/rms_norm_cuda.h"
#include "kernels/shared_expert/shared_expert_cuda.h"
#include "kernels/token_scatter/token_scatter_cuda.h"
#include "model/text/gpu/gpu_text_model.h"
#include "optim/grad_accumulate_cuda.h"

namespace deltamoe {

namespace {

// The one type of a layer's routed-expert gradients (bf16 where the state keeps them so), checked
// alike for gate_up and down where both are trained.
DType expert_grads_dtype(const MoeWeights& W) {
  CHECK(!W.experts_gate_up.trained() || !W.experts_down.trained() ||
            W.experts_gate_up.grad_dtype() == W.experts_down.grad_dtype(),
        "text model: the routed experts' gate_up and down gradients differ in type");
  return W.experts_gate_up.trained() ? W.experts_gate_up.grad_dtype() : W.experts_down.grad_dtype();
}

}  // namespace

void GpuTextModel::weight_grad(const DeviceParam& w, const DeviceBf16* dy, const DeviceBf16* x, int64_t rows,
                               int64_t in_features, int64_t out_features) {
  if (!w.trained()) return;  // frozen: no weight-gradient product
  CHECK(w.grad != nullptr, "text model: a dense weight's gradient must be fp32");
  linear_backward_weight_cuda(*gemm_, dy, x, w.grad, rows, in_features, out_features, stream_);
}

void GpuTextModel::set_lora_dropout(const LoraDropoutKey& key) {
  CHECK(key.p == 0 || lora_dropout_scratch_.bytes() > 0, "gpu model: LoRA dropout ", key.p,
        " on a model planned without it (GpuModelOptions::lora_dropout_max_in)");
  lora_dropout_ = key;
}

LoraDropoutPass GpuTextModel::lora_dropout_pass(const DeviceLoraViews& views) const {
  return LoraDropoutPass{lora_dropout_mask(lora_dropout_, views.index), lora_dropout_scratch_.data(),
                         lora_dropout_scratch_.bytes()};
}

void GpuTextModel::project(const DeviceParam& w, const DeviceBf16* x, void* y, DType y_dtype, int64_t rows,
                           int64_t in_features, int64_t out_features) {
  linear_forward_cuda(*gemm_, x, w.w, y, y_dtype, rows, in_features, out_features, stream_);
  if (!w.lora.attached()) return;
  const LoraDeviceAdapter adapter{w.lora.a, w.lora.b, w.lora.grad_a, w.lora.grad_b, w.lora.rank, w.lora.scaling};
  auto* xa = lora_scratch_.as<DeviceBf16>();
  const LoraDropoutPass dropout = lora_dropout_pass(w.lora);
  lora_linear_forward_cuda(*gemm_, x, adapter, xa, y, y_dtype, rows, in_features, out_features, stream_, &dropout);
}

void GpuTextModel::lora_backward(const DeviceParam& w, const DeviceBf16* x, const DeviceBf16* dy, void* dx,
                                 DType dx_dtype, int64_t rows, int64_t in_features, int64_t out_features) {
  if (!w.lora.attached()) return;
  const LoraDeviceAdapter adapter{w.lora.a, w.lora.b, w.lora.grad_a, w.lora.grad_b, w.lora.rank, w.lora.scaling};
  auto* xa = lora_scratch_.as<DeviceBf16>();
  DeviceBf16* dxa = xa + spec_.max_tokens * lora_rank_;
  const LoraDropoutPass dropout = lora_dropout_pass(w.lora);
  lora_linear_backward_cuda(*gemm_, x, dy, adapter, xa, /*recompute_xa=*/true, dxa, dx, dx_dtype, rows, in_features,
                            out_features, stream_, &dropout);
}

const MoeExpertsLora* GpuTextModel::experts_lora(int64_t layer, MoeExpertsLora* out) const {
  const MoeWeights& W = weights_.layers[static_cast<size_t>(layer)].mlp;
  if (!W.experts_gate_up.lora.attached() && !W.experts_down.lora.attached()) return nullptr;
  auto adapter = [](const DeviceLoraViews& v) {
    return v.attached() ? LoraDeviceAdapter{v.a, v.b, v.grad_a, v.grad_b, v.rank, v.scaling} : LoraDeviceAdapter{};
  };
  out->gate_up = adapter(W.experts_gate_up.lora);
  out->down = adapter(W.experts_down.lora);
  out->workspace = lora_experts_workspace_.data();
  out->workspace_bytes = lora_experts_workspace_.bytes();
  return out;
}

const SharedExpertLora* GpuTextModel::shared_expert_lora(int64_t layer, SharedExpertLora* out) const {
  const MoeWeights& W = weights_.layers[static_cast<size_t>(layer)].mlp;
  auto adapter = [](const DeviceLoraViews& v) {
    return v.attached() ? LoraDeviceAdapter{v.a, v.b, v.grad_a, v.grad_b, v.rank, v.scaling} : LoraDeviceAdapter{};
  };
  out->gate_proj = adapter(W.shared_gate_proj.lora);
  out->up_proj = adapter(W.shared_up_proj.lora);
  out->down_proj = adapter(W.shared_down_proj.lora);
  out->expert_gate = adapter(W.shared_expert_gate.lora);
  if (!out->any()) return nullptr;
  out->gemm = gemm_.get();
  out->scratch = lora_scratch_.data();
  out->scratch_bytes = lora_scratch_.bytes();
  out->gate_proj_dropout = lora_dropout_pass(W.shared_gate_proj.lora).mask;
  out->up_proj_dropout = lora_dropout_pass(W.shared_up_proj.lora).mask;
  out->down_proj_dropout = lora_dropout_pass(W.shared_down_proj.lora).mask;
  out->expert_gate_dropout = lora_dropout_pass(W.shared_expert_gate.lora).mask;
  out->dropout_scratch = lora_dropout_scratch_.data();
  out->dropout_scratch_bytes = lora_dropout_scratch_.bytes();
  return out;
}

void GpuTextModel::gdn_gate_projections_backward(const GdnWeights& W, const DeviceBf16* x, float* dx) {
  LayerScratch& s = acts_.scratch;
  const int64_t T = num_tokens_, C = config_.hidden_size, Hv = config_.linear_num_value_heads;
  // [da_hi | da_lo | db_hi | db_lo] [T, 4 Hv] against [Wa; Wa; Wb; Wb] [4 Hv, C]: one dX product
  // (K = 4 Hv) instead of one per half and gate, each of which read and wrote the fp32 dx.
  DeviceBf16* packed = s.gate_grad_packed;
  pack_f32_hi_lo_cuda(s.da, T, Hv, packed, 4 * Hv, 0, Hv, -1, stream_);
  pack_f32_hi_lo_cuda(s.db, T, Hv, packed, 4 * Hv, 2 * Hv, 3 * Hv, -1, stream_);
  const size_t block_bytes = static_cast<size_t>(Hv * C) * sizeof(DeviceBf16);
  for (int64_t block = 0; block < 4; ++block) {
    CUDA_CHECK(cudaMemcpyAsync(s.gate_weight_stack + block * Hv * C, (block < 2 ? W.in_proj_a : W.in_proj_b).w,
                               block_bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  linear_backward_input_f32_cuda(*gemm_, packed, s.gate_weight_stack, dx, true, T, C, 4 * Hv, stream_);
  if (W.in_proj_a.grad != nullptr || W.in_proj_b.grad != nullptr) {
    // One product forms the four parts [4 Hv, C] (written), then each gradient adds its hi and lo parts.
    float* parts = s.gate_weight_grads;
    gemm_bf16_cuda(*gemm_, true, false, 4 * Hv, C, T, 1.0f, packed, 4 * Hv, x, C, 0.0f, parts, DType::f32, C, stream_);
    const float* a_parts = parts;
    const float* b_parts = parts + 2 * Hv * C;
    for (const auto& [grad, part] : {std::pair{W.in_proj_a.grad, a_parts}, std::pair{W.in_proj_b.grad, b_parts}}) {
      if (grad == nullptr) continue;
      add_f32_cuda(part, grad, Hv * C, stream_);
      add_f32_cuda(part + Hv * C, grad, Hv * C, stream_);
    }
  }
  // An adapter's products are linear in dy: once per dense half (after the packed blocks).
  DeviceBf16* hi = packed + T * 4 * Hv;
  DeviceBf16* lo = hi + T * Hv;
  for (const auto& [dy, w] : {std::pair{s.da, &W.in_proj_a}, std::pair{s.db, &W.in_proj_b}}) {
    if (!w->lora.attached()) continue;
    split_f32_to_bf16_hi_lo_cuda(dy, hi, lo, T * Hv, stream_);
    lora_backward(*w, x, hi, dx, DType::f32, T, C, Hv);
    lora_backward(*w, x, lo, dx, DType::f32, T, C, Hv);
  }
}

std::vector<float> GpuTextModel::compute_logits() const {
  const int64_t T = num_tokens_, V = config_.vocab_size;
  CHECK(T > 0, "gpu model: compute_logits called before a forward");
  DeviceBuffer logits(static_cast<size_t>(T * V) * sizeof(float));
  linear_forward_cuda(*gemm_, acts_.final_normed, weights_.lm_head.w, logits.data(), DType::f32, T,
                      config_.hidden_size, V, stream_);
  std::vector<float> host(static_cast<size_t>(T * V));
  CUDA_CHECK(cudaMemcpyAsync(host.data(), logits.data(), logits.bytes(), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return host;
}

void GpuTextModel::forward() {
  CHECK(num_tokens_ > 0, "gpu model: forward called before set_batch");
  CHECK(last_image_row_ < num_tokens_, "gpu model: image-token row ", last_image_row_, " is outside the batch of ",
        num_tokens_, " tokens (set_image_rows and set_batch disagree)");
  const TextConfig& c = config_;
  const int64_t T = num_tokens_, C = c.hidden_size;
  const double eps = c.rms_norm_eps;
  timer_.mark(StepComponent::other, stream_);
  // The stream starts as fp32 rows of the fp32 master table (layer 0's x_in is acts_.embedded).
  embedding_forward_cuda(inputs_.ids, weights_.embed_tokens.f32, acts_.embedded, T, c.vocab_size, C, nullptr,
                         stream_);
  // VLM input: the vision features replace the <|image_pad|> rows' embeddings.
  if (num_image_rows_ > 0)
    token_scatter_forward_cuda(acts_.image_rows, acts_.image_embeds, num_image_rows_, acts_.embedded, T, C, stream_);
  moe_aux_stats_reset_cuda(MoeAuxDeviceStats{inputs_.aux_counts, inputs_.aux_probs}, c.num_experts, stream_);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layer_forward(i, /*recompute=*/false);
  timer_.mark(StepComponent::other, stream_);
  const LayerActivations& last = acts_.layers.back();
  rms_norm_forward_cuda(last.moe_out, last.h, acts_.final_hidden, weights_.norm.f32, acts_.final_normed,
                        acts_.final_rstd, T, C, eps, stream_);
  moe_aux_loss_value_cuda(MoeAuxDeviceStats{inputs_.aux_counts, inputs_.aux_probs}, c.num_experts, T * c.num_hidden_layers,
                          inputs_.aux_loss, stream_);
}

void GpuTextModel::layer_forward(int64_t i, bool recompute) {
  const TextConfig& c = config_;
  const int64_t T = num_tokens_, C = c.hidden_size;
  const double eps = c.rms_norm_eps;
  LayerActivations& b = acts_.layers[static_cast<size_t>(i)];
  const DecoderLayerWeights& W = weights_.layers[static_cast<size_t>(i)];
  timer_.mark(StepComponent::other, stream_);
  if (i == 0 || recompute) {
    // A rerun starts from the layer's kept fp32 input (the same values the first pass normalised).
    rms_norm_forward_cuda(nullptr, b.x_in, nullptr, W.input_layernorm.f32, b.normed_in, b.rstd_in, T, C, eps, stream_);
  } else {
    // x_in = previous h + previous MoE output (the previous layer's residual add).
    const LayerActivations& prev = acts_.layers[static_cast<size_t>(i - 1)];
    rms_norm_forward_cuda(prev.moe_out, prev.h, b.x_in, W.input_layernorm.f32, b.normed_in, b.rstd_in, T, C, eps,
                          stream_);
  }
  if (b.is_gdn) {
    timer_.mark(StepComponent::gdn, stream_);
    gdn_forward(i);
  } else {
    timer_.mark(StepComponent::attention, stream_);
    attention_forward(i);
  }
  timer_.mark(StepComponent::other, stream_);
  rms_norm_forward_cuda(b.mixer_out, b.x_in, b.h, W.post_attention_layernorm.f32, b.normed_post, b.rstd_post, T, C,
                        eps, stream_);
  timer_.mark(StepComponent::moe, stream_);
  moe_forward(i, recompute);
}

void GpuTextModel::forward_loss() {
  forward();
  timer_.mark(StepComponent::lm_head_loss, stream_);
  LmHeadLossArgs loss;
  loss.hidden = acts_.final_normed;
  loss.weight = weights_.lm_head.w;
  loss.labels = inputs_.labels;
  loss.num_tokens = num_tokens_;
  loss.hidden_size = config_.hidden_size;
  loss.vocab = config_.vocab_size;
  loss.num_supervised = num_supervised_;
  loss.rows = inputs_.supervised_rows;
  loss.num_rows = num_supervised_;
  loss.d_loss = 0.0f;
  loss.chunk_rows = options_.loss_chunk_rows;
  loss.token_loss = inputs_.token_loss;
  loss.lse = inputs_.lse;
  loss.loss = inputs_.loss;
  // d_hidden and d_weight null: the loss only, no backward.
  lm_head_cross_entropy_cuda(*gemm_, loss, workspace_.data(), workspace_bytes_, stream_);
}

void GpuTextModel::set_lm_head_gradient_written_first(bool on) {
  CHECK(!on || weights_.lm_head.grad != nullptr, "text model: lm_head is frozen; it has no gradient to write first");
  lm_head_written_first_ = on;
  lm_head_grad_holds_sum_ = true;
}

void GpuTextModel::begin_gradient_step(const ExpertSquaresSink* squares) {
  lm_head_grad_holds_sum_ = !lm_head_written_first_;
  for (size_t l = 0; l < expert_grads_hold_sum_.size(); ++l) {
    const MoeWeights& W = weights_.layers[l].mlp;
    // Only trained experts form a gradient; frozen ones (null) have nothing to write.
    expert_grads_hold_sum_[l] = !W.experts_gate_up.trained() && !W.experts_down.trained();
  }
  expert_squares_.reset();
  if (squares != nullptr) {
    CHECK(squares->sums != nullptr && squares->scratch != nullptr && squares->divisor > 0,
          "text model: the experts' sums of squares need their slots, scratch and a positive divisor");
    // Layers no backward reaches, and frozen experts, keep 0.
    CUDA_CHECK(cudaMemsetAsync(squares->sums, 0, 2 * expert_grads_hold_sum_.size() * sizeof(double), stream_));
    expert_squares_ = *squares;
  }
}

void GpuTextModel::zero_unwritten_gradients() {
  if (!lm_head_grad_holds_sum_) {
    CUDA_CHECK(cudaMemsetAsync(weights_.lm_head.grad, 0,
                               static_cast<size_t>(config_.vocab_size * config_.hidden_size) * sizeof(float), stream_));
    lm_head_grad_holds_sum_ = true;
  }
  for (size_t l = 0; l < expert_grads_hold_sum_.size(); ++l) {
    if (expert_grads_hold_sum_[l]) continue;
    const MoeWeights& W = weights_.layers[l].mlp;
    for (const DeviceParam* p : {&W.experts_gate_up, &W.experts_down}) {
      if (p->trained())
        CUDA_CHECK(cudaMemsetAsync(p->grad_data(), 0, static_cast<size_t>(p->numel) * dtype_size(p->grad_dtype()),
                                   stream_));
    }
    expert_grads_hold_sum_[l] = 1;
  }
  expert_squares_.reset();
}

void GpuTextModel::backward() {
  const TextConfig& c = config_;
  const int64_t T = num_tokens_, C = c.hidden_size;
  timer_.mark(StepComponent::lm_head_loss, stream_);
  LmHeadLossArgs loss;
  loss.hidden = acts_.final_normed;
  loss.weight = weights_.lm_head.w;
  loss.labels = inputs_.labels;
  loss.num_tokens = T;
  loss.hidden_size = C;
  loss.vocab = c.vocab_size;
  loss.num_supervised = num_supervised_;
  loss.rows = inputs_.supervised_rows;
  loss.num_rows = num_supervised_;
  loss.d_loss = options_.ce_loss_weight;
  loss.chunk_rows = options_.loss_chunk_rows;
  loss.token_loss = inputs_.token_loss;
  loss.lse = inputs_.lse;
  loss.loss = inputs_.loss;
  loss.d_hidden = acts_.grad_normed;
  loss.d_weight = weights_.lm_head.grad;
  // The step's first backward writes lm_head's gradient (begin_gradient_step).
  loss.d_weight_written = loss.d_weight != nullptr && !lm_head_grad_holds_sum_;
  lm_head_grad_holds_sum_ = true;
  lm_head_cross_entropy_cuda(*gemm_, loss, workspace_.data(), workspace_bytes_, stream_);

  timer_.mark(StepComponent::other, stream_);
  // acts_.grad_stream (fp32) holds the gradient reaching the current layer's output (h + moe_out), and
  // after the layer's input norm the gradient reaching its input; acts_.grad_stream_bf16 is its copy.
  float* d_stream = acts_.grad_stream;
  // The fp32 input gradient of a block (the MoE block's, then the mixer's): each norm backward
  // reads it unrounded.
  float* d_mixer_input = acts_.scratch.d_mixer_input_f32;
  rms_norm_backward_cuda(acts_.final_hidden, weights_.norm.f32, acts_.final_rstd, acts_.grad_normed, nullptr,
                         d_stream, acts_.grad_stream_bf16, weights_.norm.grad, T, C, workspace_.data(),
                         workspace_bytes_, stream_);
  if (gradient_ready_) gradient_ready_({GradientPhaseKind::text_head, 0});
  for (int64_t i = c.num_hidden_layers - 1; i >= 0; --i) {
    const LayerActivations& b = acts_.layers[static_cast<size_t>(i)];
    // A fully recomputed layer kept only its input: rerun its forward (router included, experts
    // not: their backward recomputes their activations anyway) into the shared set.
    const bool recomputed = i < options_.recompute_layers;
    if (recomputed) layer_forward(i, /*recompute=*/true);
    capture_gradient(i, LayerGradient::output, d_stream);
    timer_.mark(StepComponent::moe, stream_);
    moe_backward(i, acts_.grad_stream_bf16, d_mixer_input);  // the MoE block's input gradient, fp32
    timer_.mark(StepComponent::other, stream_);
    // dh = norm backward + d_stream (the residual path around the MoE block).
    rms_norm_backward_cuda(b.h, weights_.layers[static_cast<size_t>(i)].post_attention_layernorm.f32, b.rstd_post, d_mixer_input, d_stream,
                           acts_.grad_mixer, acts_.grad_mixer_bf16, weights_.layers[static_cast<size_t>(i)].post_attention_layernorm.grad, T, C,
                           workspace_.data(), workspace_bytes_, stream_);
    capture_gradient(i, LayerGradient::after_mixer, acts_.grad_mixer);
    if (b.is_gdn) {
      timer_.mark(StepComponent::gdn, stream_);
      if (options_.recompute_mixers && !recomputed) gdn_forward(i);  // refills the shared intermediates (and mixer_out, unused now)
      gdn_backward(i, acts_.grad_mixer_bf16, d_mixer_input);
    } else {
      timer_.mark(StepComponent::attention, stream_);
      if (options_.recompute_mixers && !recomputed) attention_forward(i);
      attention_backward(i, acts_.grad_mixer_bf16, d_mixer_input);
    }
    timer_.mark(StepComponent::other, stream_);
    // The mixer's fp32 input gradient goes into the norm as is; d_stream is free again after the
    // post-norm backward and now receives the gradient reaching the layer's input.
    rms_norm_backward_cuda(b.x_in, weights_.layers[static_cast<size_t>(i)].input_layernorm.f32, b.rstd_in, d_mixer_input, acts_.grad_mixer,
                           d_stream, acts_.grad_stream_bf16, weights_.layers[static_cast<size_t>(i)].input_layernorm.grad, T, C, workspace_.data(),
                           workspace_bytes_, stream_);
    capture_gradient(i, LayerGradient::input, d_stream);
    if (gradient_ready_) gradient_ready_({GradientPhaseKind::text_layer, i});
  }
  // The image rows' gradient belongs to the vision features, not to the <|image_pad|> table row:
  // gather it, then zero those rows before the table's backward (multimodal_embed_backward).
  if (num_image_rows_ > 0)
    token_scatter_backward_cuda(acts_.image_rows, d_stream, acts_.image_grads, num_image_rows_, T, C, stream_);
  if (weights_.embed_tokens.grad != nullptr) {
    embedding_backward_cuda(inputs_.embed_sorted_tokens, inputs_.embed_segment_offsets, inputs_.embed_segment_ids,
                            num_embed_segments_, d_stream, weights_.embed_tokens.grad, C, stream_);
  }
  if (gradient_ready_) gradient_ready_({GradientPhaseKind::text_embedding, 0});
}

// ---- Gated DeltaNet (gdn_layer.cc) ----

void GpuTextModel::gdn_forward(int64_t layer) {
  const TextConfig& c = config_;
  LayerActivations& b = acts_.layers[static_cast<size_t>(layer)];
  GdnSaved& s = b.gdn;
  const int64_t T = num_tokens_, C = c.hidden_size, kd = c.key_dim(), vd = c.value_dim(), conv = c.conv_dim();
  const int64_t Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
  const int Dk = static_cast<int>(c.linear_key_head_dim), Dv = static_cast<int>(c.linear_value_head_dim);
  const GdnWeights& W = weights_.layers[static_cast<size_t>(layer)].linear_attn;
  project(W.in_proj_qkv, b.normed_in, s.mixed, DType::bf16, T, C, conv);
  project(W.in_proj_z, b.normed_in, s.z, DType::bf16, T, C, vd);
  // The gate pre-activations stay fp32 (GdnSaved::a): cuBLASLt writes its fp32 accumulator as is.
  project(W.in_proj_b, b.normed_in, s.b, DType::f32, T, C, Hv);
  project(W.in_proj_a, b.normed_in, s.a, DType::f32, T, C, Hv);
  // The conv output's q | k | v columns land in their own dense tensors.
  CausalConv1dOutput qkv;
  qkv.part[0] = s.q;
  qkv.part[1] = s.k;
  qkv.part[2] = s.v;
  qkv.width[0] = kd;
  qkv.width[1] = kd;
  qkv.width[2] = vd;
  causal_conv1d_forward_cuda(s.mixed, W.conv1d.w, inputs_.cu_seqlens, static_cast<int>(num_seqs_), T,
                             static_cast<int>(conv), static_cast<int>(c.linear_conv_kernel_dim), qkv, stream_);
  l2norm_forward_cuda(s.q, T * Hk, Dk, s.q_normed, stream_);
  l2norm_forward_cuda(s.k, T * Hk, Dk, s.k_normed, stream_);
  // A_log and dt_bias are read in fp32 straight from the master weights, as the reference does.
  gdn_gates_forward_cuda(s.a, s.b, W.A_log.f32, W.dt_bias.f32, T, static_cast<int>(Hv),
                         s.g, s.beta, stream_);
  const GatedDeltaRuleShape shape = gdn_rule_shape();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dk)));
  // The rule's forward workspace is the set's own when kept for the backward, else the shared one.
  void* rule_workspace = s.rule_forward != nullptr ? s.rule_forward : workspace_.data();
  const size_t rule_workspace_bytes = s.rule_forward != nullptr ? s.rule_forward_bytes : workspace_bytes_;
  gated_delta_rule_forward_cuda(shape, scale, s.q_normed, s.k_normed, s.v, s.g, s.beta, nullptr, s.core, nullptr,
                                rule_workspace, rule_workspace_bytes, stream_);
  gated_rmsnorm_forward_cuda(s.core, s.z, W.norm.f32, T * Hv, Dv,
                             static_cast<float>(c.rms_norm_eps), s.normed, stream_);
  project(W.out_proj, s.normed, b.mixer_out, DType::bf16, T, vd, C);
}

void GpuTextModel::gdn_backward(int64_t layer, const DeviceBf16* dy, float* dx) {
  const TextConfig& c = config_;
  const LayerActivations& b = acts_.layers[static_cast<size_t>(layer)];
  const GdnSaved& s = b.gdn;
  LayerScratch& w = acts_.scratch;
  const int64_t T = num_tokens_, C = c.hidden_size, kd = c.key_dim(), vd = c.value_dim(), conv = c.conv_dim();
  const int64_t Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
  const int Dk = static_cast<int>(c.linear_key_head_dim), Dv = static_cast<int>(c.linear_value_head_dim);
  const GdnWeights& W = weights_.layers[static_cast<size_t>(layer)].linear_attn;
  linear_backward_input_cuda(*gemm_, dy, W.out_proj.w, w.d_normed_v, T, vd, C, stream_);
  lora_backward(W.out_proj, s.normed, dy, w.d_normed_v, DType::bf16, T, vd, C);
  weight_grad(W.out_proj, dy, s.normed, T, vd, C);
  gated_rmsnorm_backward_cuda(s.core, s.z, W.norm.f32, w.d_normed_v, T * Hv, Dv, static_cast<float>(c.rms_norm_eps),
                              w.d_core, w.dz, W.norm.grad, workspace_.data(), workspace_bytes_, stream_);
  const GatedDeltaRuleShape shape = gdn_rule_shape();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dk)));
  if (s.rule_forward != nullptr) {
    // The forward's chunk quantities and states kept since this set's forward: not recomputed.
    gated_delta_rule_backward_after_forward_cuda(shape, scale, s.q_normed, s.k_normed, s.v, s.g, s.beta, nullptr,
                                                 w.d_core, nullptr, w.dq_normed, w.dk_normed, w.dv, w.dg, w.dbeta,
                                                 nullptr, s.rule_forward, s.rule_forward_bytes, workspace_.data(),
                                                 workspace_bytes_, stream_);
  } else {
    gated_delta_rule_backward_cuda(shape, scale, s.q_normed, s.k_normed, s.v, s.g, s.beta, nullptr, w.d_core,
                                   nullptr, w.dq_normed, w.dk_normed, w.dv, w.dg, w.dbeta, nullptr, workspace_.data(),
                                   workspace_bytes_, stream_);
  }
  // The conv's output gradient as its q | k | v blocks: dq and dk (dense, in w.d_conv) and dv.
  DeviceBf16* dq = w.d_conv;
  DeviceBf16* dk = w.d_conv + T * kd;
  l2norm_backward_cuda(s.q, w.dq_normed, T * Hk, Dk, dq, stream_);
  l2norm_backward_cuda(s.k, w.dk_normed, T * Hk, Dk, dk, stream_);
  CausalConv1dOutputGrad d_qkv;
  d_qkv.part[0] = dq;
  d_qkv.part[1] = dk;
  d_qkv.part[2] = w.dv;
  d_qkv.width[0] = kd;
  d_qkv.width[1] = kd;
  d_qkv.width[2] = vd;
  gdn_gates_backward_cuda(s.a, s.b, W.A_log.f32, W.dt_bias.f32, w.dg, w.dbeta, T,
                          static_cast<int>(Hv), w.da, w.db, W.A_log.grad, W.dt_bias.grad,
                          stream_);
  causal_conv1d_backward_cuda(s.mixed, W.conv1d.w, d_qkv, inputs_.cu_seqlens, static_cast<int>(num_seqs_), T,
                              static_cast<int>(conv), static_cast<int>(c.linear_conv_kernel_dim), w.d_mixed,
                              W.conv1d.grad, workspace_.data(), workspace_bytes_, stream_);
  const DeviceBf16* x = b.normed_in;
  linear_backward_input_f32_cuda(*gemm_, w.d_mixed, W.in_proj_qkv.w, dx, false, T, C, conv,
                                 stream_);
  lora_backward(W.in_proj_qkv, x, w.d_mixed, dx, DType::f32, T, C, conv);
  weight_grad(W.in_proj_qkv, w.d_mixed, x, T, C, conv);
  linear_backward_input_f32_cuda(*gemm_, w.dz, W.in_proj_z.w, dx, true, T, C, vd, stream_);
  lora_backward(W.in_proj_z, x, w.dz, dx, DType::f32, T, C, vd);
  weight_grad(W.in_proj_z, w.dz, x, T, C, vd);
  gdn_gate_projections_backward(W, x, dx);
}

// ---- gated attention (attention_layer.cc) ----

void GpuTextModel::attention_forward(int64_t layer) {
  const TextConfig& c = config_;
  LayerActivations& b = acts_.layers[static_cast<size_t>(layer)];
  AttentionSaved& s = b.attn;
  const int64_t T = num_tokens_, C = c.hidden_size, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const int64_t D = c.head_dim;
  const AttentionWeights& W = weights_.layers[static_cast<size_t>(layer)].self_attn;
  // q_proj rows per head h: [2hD, 2hD + D) query, [2hD + D, 2(h + 1)D) gate.
  project(W.q_proj, b.normed_in, s.q_and_gate, DType::bf16, T, C, Hq * 2 * D);
  project(W.k_proj, b.normed_in, s.k_raw, DType::bf16, T, C, Hkv * D);
  project(W.v_proj, b.normed_in, s.v, DType::bf16, T, C, Hkv * D);
  rms_norm_forward_strided_cuda(s.q_and_gate, 2 * D, W.q_norm.f32, s.q, s.q_rstd, T * Hq, D,
                                c.rms_norm_eps, stream_);
  rms_norm_forward_strided_cuda(s.k_raw, D, W.k_norm.f32, s.k, s.k_rstd, T * Hkv, D,
                                c.rms_norm_eps, stream_);
  mrope_forward_cuda(rope_, s.q, inputs_.rope_cos, inputs_.rope_sin, s.q, T, Hq, D, stream_);
  mrope_forward_cuda(rope_, s.k, inputs_.rope_cos, inputs_.rope_sin, s.k, T, Hkv, D, stream_);
  const AttentionDims dims{T, Hq, Hkv, D};
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  if (cudnn_attention_ != nullptr) {
    cudnn_attention_->forward(s.q, s.k, s.v, inputs_.cu_seqlens, num_seqs_, s.attn, s.lse, workspace_.data(),
                              workspace_bytes_, stream_);
  } else {
    attention_forward_cuda(dims, s.q, s.k, s.v, inputs_.cu_seqlens, num_seqs_, scale, s.attn, s.lse, stream_);
  }
  attention_gate_forward_cuda(s.attn, s.q_and_gate + D, 2 * D, s.gated, T * Hq, D, stream_);
  project(W.o_proj, s.gated, b.mixer_out, DType::bf16, T, Hq * D, C);
}

void GpuTextModel::attention_backward(int64_t layer, const DeviceBf16* dy, float* dx) {
  const TextConfig& c = config_;
  const LayerActivations& b = acts_.layers[static_cast<size_t>(layer)];
  const AttentionSaved& s = b.attn;
  LayerScratch& w = acts_.scratch;
  const int64_t T = num_tokens_, C = c.hidden_size, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const int64_t D = c.head_dim;
  const AttentionWeights& W = weights_.layers[static_cast<size_t>(layer)].self_attn;
  linear_backward_input_cuda(*gemm_, dy, W.o_proj.w, w.d_gated, T, Hq * D, C, stream_);
  lora_backward(W.o_proj, s.gated, dy, w.d_gated, DType::bf16, T, Hq * D, C);
  weight_grad(W.o_proj, dy, s.gated, T, Hq * D, C);
  // d_attn overwrites d_gated in place; d_gate goes straight into the gate half of d_q_and_gate.
  attention_gate_backward_cuda(s.attn, s.q_and_gate + D, 2 * D, w.d_gated, w.d_gated, w.d_q_and_gate + D, 2 * D,
                               T * Hq, D, stream_);
  const AttentionDims dims{T, Hq, Hkv, D};
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  if (cudnn_attention_ != nullptr) {
    cudnn_attention_->backward(s.q, s.k, s.v, s.attn, s.lse, w.d_gated, inputs_.cu_seqlens, num_seqs_, w.dq, w.dk,
                               w.dv_attn, workspace_.data(), workspace_bytes_, stream_);
  } else {
    attention_backward_cuda(dims, s.q, s.k, s.v, s.attn, s.lse, w.d_gated, inputs_.cu_seqlens, num_seqs_, scale, w.dq,
                            w.dk, w.dv_attn, workspace_.data(), workspace_bytes_, stream_);
  }
  mrope_backward_cuda(rope_, w.dq, inputs_.rope_cos, inputs_.rope_sin, w.dq, T, Hq, D, stream_);
  mrope_backward_cuda(rope_, w.dk, inputs_.rope_cos, inputs_.rope_sin, w.dk, T, Hkv, D, stream_);
  rms_norm_backward_strided_cuda(s.q_and_gate, 2 * D, W.q_norm.f32, s.q_rstd, w.dq,
                                 w.d_q_and_gate, 2 * D, W.q_norm.grad, T * Hq, D, workspace_.data(),
                                 workspace_bytes_, stream_);
  rms_norm_backward_strided_cuda(s.k_raw, D, W.k_norm.f32, s.k_rstd, w.dk, w.dk_raw, D,
                                 W.k_norm.grad, T * Hkv, D, workspace_.data(), workspace_bytes_,
                                 stream_);
  const DeviceBf16* x = b.normed_in;
  linear_backward_input_f32_cuda(*gemm_, w.d_q_and_gate, W.q_proj.w, dx, false, T, C,
                                 Hq * 2 * D, stream_);
  lora_backward(W.q_proj, x, w.d_q_and_gate, dx, DType::f32, T, C, Hq * 2 * D);
  weight_grad(W.q_proj, w.d_q_and_gate, x, T, C, Hq * 2 * D);
  linear_backward_input_f32_cuda(*gemm_, w.dk_raw, W.k_proj.w, dx, true, T, C, Hkv * D,
                                 stream_);
  lora_backward(W.k_proj, x, w.dk_raw, dx, DType::f32, T, C, Hkv * D);
  weight_grad(W.k_proj, w.dk_raw, x, T, C, Hkv * D);
  linear_backward_input_f32_cuda(*gemm_, w.dv_attn, W.v_proj.w, dx, true, T, C, Hkv * D,
                                 stream_);
  lora_backward(W.v_proj, x, w.dv_attn, dx, DType::f32, T, C, Hkv * D);
  weight_grad(W.v_proj, w.dv_attn, x, T, C, Hkv * D);
}

// ---- sparse MoE block (moe_block.cc) ----

void GpuTextModel::split_router_operands(int64_t layer) {
  const LayerActivations& b = acts_.layers[static_cast<size_t>(layer)];
  LayerScratch& w = acts_.scratch;
  const int64_t T = num_tokens_, C = config_.hidden_size, E = config_.num_experts;
  rms_norm_output_low_part_cuda(b.h, weights_.layers[static_cast<size_t>(layer)].post_attention_layernorm.f32, b.rstd_post, b.normed_post,
                                w.router_x_lo, T, C, stream_);
  // w_hi, w_lo: the first two blocks of the stack [w_hi; w_lo; w_hi] (the backward adds the third).
  split_f32_to_bf16_hi_lo_cuda(weights_.layers[static_cast<size_t>(layer)].mlp.gate.f32, w.gate_weight_stack,
                               w.gate_weight_stack + E * C, E * C, stream_);
}

void GpuTextModel::moe_forward(int64_t layer, bool recompute) {
  const TextConfig& c = config_;
  LayerActivations& b = acts_.layers[static_cast<size_t>(layer)];
  MoeSaved& s = b.moe;
  const int64_t T = num_tokens_, C = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  const int64_t Is = c.shared_expert_intermediate_size;
  const MoeWeights& W = weights_.layers[static_cast<size_t>(layer)].mlp;
  split_router_operands(layer);
  moe_router_logits_split_cuda(*gemm_, b.normed_post, acts_.scratch.router_x_lo, acts_.scratch.gate_weight_stack,
                               acts_.scratch.gate_weight_stack + E * C, s.logits, T, C, E, stream_);
  moe_router_forward_cuda(s.logits, s.probs, s.topk_idx, s.topk_weight, T, E, K, stream_);
  // A rerun refills the router's outputs only: the aux statistics already count this layer, the
  // expert-parallel plan of the layer is kept, and the experts' backward recomputes their rows.
  if (!recompute)
    moe_aux_loss_accumulate_cuda(s.probs, s.topk_idx, T, E, K, MoeAuxDeviceStats{inputs_.aux_counts, inputs_.aux_probs},
                                 workspace_.data(), workspace_bytes_, stream_);
  SharedExpertLora shared_lora;
  if (expert_parallel_ != nullptr) {
    if (recompute) return;
    // The count exchange is enqueued and the host waits for it in forward(): the shared expert's
    // products, enqueued in between, keep the GPU busy meanwhile. Its gated output is added after
    // the combine by the same kernel as the fused call below, so the sum is bitwise one rank's.
    expert_parallel_->start_forward(layer, T, s.topk_idx);
    const SharedExpertPending pending =
        shared_expert_pending_in(shared_expert_pending_.data(), shared_expert_pending_.bytes(), T, C);
    shared_expert_forward_products_cuda(*gemm_, b.normed_post, W.shared_gate_proj.w, W.shared_up_proj.w,
                                        W.shared_down_proj.w, W.shared_expert_gate.w, pending, T, C, Is,
                                        workspace_.data(), workspace_bytes_, stream_,
                                        shared_expert_lora(layer, &shared_lora));
    // The bound expert stacks hold this rank's experts only, local expert 0 first.
    expert_parallel_->forward(layer, s.topk_weight, b.normed_post, W.experts_gate_up.w, W.experts_down.w, b.moe_out);
    shared_expert_forward_apply_cuda(pending, b.moe_out, true, T, C, stream_);
    return;
  }
  moe_routing_plan_cuda(s.topk_idx, plans_[static_cast<size_t>(layer)], T, E, K, stream_);
  if (recompute) return;
  const MoeExpertsDims dims{T, C, E, K, c.moe_intermediate_size};
  MoeExpertsLora lora;
  const MoeExpertRows keep{s.input_rows, s.gate_up_rows};
  moe_experts_forward_cuda(dims, plans_[static_cast<size_t>(layer)], b.normed_post, s.topk_weight,
                           W.experts_gate_up.w, W.experts_down.w, b.moe_out, workspace_.data(), workspace_bytes_,
                           stream_, experts_lora(layer, &lora), &keep);
  shared_expert_forward_cuda(*gemm_, b.normed_post, W.shared_gate_proj.w,
                             W.shared_up_proj.w,
                             W.shared_down_proj.w,
                             W.shared_expert_gate.w, b.moe_out, true, T, C, Is,
                             workspace_.data(), workspace_bytes_, stream_, shared_expert_lora(layer, &shared_lora));
}

void GpuTextModel::moe_backward(int64_t layer, const DeviceBf16* dy, float* dx) {
  const TextConfig& c = config_;
  const LayerActivations& b = acts_.layers[static_cast<size_t>(layer)];
  const MoeSaved& s = b.moe;
  LayerScratch& w = acts_.scratch;
  const int64_t T = num_tokens_, C = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  const int64_t Is = c.shared_expert_intermediate_size;
  const MoeWeights& W = weights_.layers[static_cast<size_t>(layer)].mlp;
  const MoeExpertsDims dims{T, C, E, K, c.moe_intermediate_size};
  // The three input gradients (routed experts, router, shared expert) are summed in fp32 into dx;
  // the experts' and the shared expert's arrive as bf16 (acts_.grad_normed, acts_.grad_mixer_bf16: both
  // free until the post-attention norm's backward).
  DeviceBf16* experts_dx = acts_.grad_normed;
  DeviceBf16* shared_dx = acts_.grad_mixer_bf16;
  // The step's first product into this layer's expert gradients writes them (see
  // begin_gradient_step).
  uint8_t& holds_sum = expert_grads_hold_sum_[static_cast<size_t>(layer)];
  const WeightGradOutput expert_grads = holds_sum ? WeightGradOutput::added_to : WeightGradOutput::written;
  // Their sums of squares, when asked for, come with the written products only.
  CHECK(!expert_squares_ || expert_grads == WeightGradOutput::written ||
            (!W.experts_gate_up.trained() && !W.experts_down.trained()),
        "text model: layer ", layer, "'s expert gradients were already formed this step, and their sums of squares "
        "with them; a step that asks for the sums runs one backward");
  ExpertGradSquares squares;
  const bool with_squares = expert_squares_ && expert_grads == WeightGradOutput::written;
  if (with_squares) {
    squares = ExpertGradSquares{expert_squares_->sums + 2 * layer, expert_squares_->sums + 2 * layer + 1,
                                expert_squares_->divisor, expert_squares_->scratch};
  }
  holds_sum = 1;
  if (expert_parallel_ != nullptr) {
    expert_parallel_->backward(layer, s.topk_weight, b.normed_post, W.experts_gate_up.w, W.experts_down.w, dy,
                               experts_dx, w.d_topk_weight, W.experts_gate_up.grad_data(), W.experts_down.grad_data(),
                               expert_grads_dtype(W), expert_grads,
                               with_squares ? &squares : nullptr);
  } else {
    MoeExpertsLora lora;
    const MoeExpertRows kept{s.input_rows, s.gate_up_rows};
    moe_experts_backward_cuda(dims, plans_[static_cast<size_t>(layer)], b.normed_post, s.topk_weight,
                              W.experts_gate_up.w, W.experts_down.w, dy, experts_dx, w.d_topk_weight,
                              W.experts_gate_up.grad_data(), W.experts_down.grad_data(), expert_grads_dtype(W),
                              workspace_.data(), workspace_bytes_,
                              stream_, experts_lora(layer, &lora), expert_grads, with_squares ? &squares : nullptr,
                              &kept);
  }
  const bool with_aux = options_.aux_loss_weight != 0.0f;
  if (with_aux)
    moe_aux_loss_backward_cuda(s.probs, MoeAuxDeviceStats{inputs_.aux_counts, inputs_.aux_probs}, T * c.num_hidden_layers,
                               options_.aux_loss_weight, w.d_logits, false, T, E, stream_);
  moe_router_backward_cuda(s.probs, s.topk_idx, s.topk_weight, w.d_topk_weight, w.d_logits, nullptr, with_aux, T, E,
                           K, stream_);
  // The router's logit gradient stays fp32 (it was rounded to bf16 here): its weight gradient is a
  // sum over tokens that cancels. Every operand is a hi/lo pair (the forward's, remade), with the
  // lo x lo terms left out. Its input gradient is one product written to dx in fp32, of the stacked
  // blocks [dl_hi | dl_hi | dl_lo] [T, 3E] and [w_hi; w_lo; w_hi] [3E, C].
  split_router_operands(layer);
  DeviceBf16* stack = w.gate_weight_stack;
  CUDA_CHECK(cudaMemcpyAsync(stack + 2 * E * C, stack, static_cast<size_t>(E * C) * sizeof(DeviceBf16),
                             cudaMemcpyDeviceToDevice, stream_));
  DeviceBf16* packed = w.gate_grad_packed;
  pack_f32_hi_lo_cuda(w.d_logits, T, E, packed, 3 * E, /*hi_col=*/0, /*lo_col=*/2 * E, /*hi2_col=*/E, stream_);
  linear_backward_input_f32_cuda(*gemm_, packed, stack, dx, false, T, C, 3 * E, stream_);
  if (float* d_router = W.gate.grad; d_router != nullptr) {
    // d_router += dl_hi^T x_hi + dl_lo^T x_hi + dl_hi^T x_lo, the blocks read in place (rows of 3E).
    const auto add_product = [&](const DeviceBf16* dl_block, const DeviceBf16* x_part) {
      gemm_bf16_cuda(*gemm_, true, false, E, C, T, 1.0f, dl_block, 3 * E, x_part, C, 1.0f, d_router, DType::f32, C,
                     stream_);
    };
    add_product(packed, b.normed_post);
    add_product(packed + 2 * E, b.normed_post);
    add_product(packed, w.router_x_lo);
  }
  SharedExpertLora shared_lora;
  shared_expert_backward_cuda(*gemm_, b.normed_post, W.shared_gate_proj.w,
                              W.shared_up_proj.w,
                              W.shared_down_proj.w,
                              W.shared_expert_gate.w, dy, shared_dx, false,
                              W.shared_gate_proj.grad,
                              W.shared_up_proj.grad,
                              W.shared_down_proj.grad,
                              W.shared_expert_gate.grad, T, C, Is, workspace_.data(),
                              workspace_bytes_, stream_, shared_expert_lora(layer, &shared_lora));
  // dx = (router + routed experts) + shared expert, in fp32, in one pass.
  add_bf16_pair_to_f32_cuda(experts_dx, shared_dx, dx, T * C, stream_);
}

}  // namespace deltamoe
