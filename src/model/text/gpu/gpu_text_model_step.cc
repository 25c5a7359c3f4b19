// GpuTextModel's forward and backward schedules, following the CPU reference model
// (src/model/text: decoder.cc, text_model.cc) operation for operation: the embedding, each layer's
// norms around its mixer and MoE block (gpu_gdn_layer.cc, gpu_attention_layer.cc, gpu_moe_block.cc),
// the loss head, and the projection funnel they all call; residual adds are fused into the
// following RMSNorm. Precision follows transformers' bf16 autocast with fp32 parameters: bf16 GEMM
// operands, an fp32 residual stream and stream gradient, norm weights and the embedding read in
// fp32. Frozen weights (null gradient views) skip their weight-gradient work. One stream, no
// allocation, no host synchronisation but, with expert parallelism, the exchange plan's one wait
// per MoE layer (gpu_expert_parallel.h).
#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/cross_entropy/cross_entropy_cuda.h"
#include "kernels/embedding/embedding_cuda.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/lora/lora_cuda.h"
#include "kernels/moe_aux_loss/moe_aux_loss_cuda.h"
#include "kernels/rms_norm/rms_norm_cuda.h"
#include "kernels/token_scatter/token_scatter_cuda.h"
#include "model/text/gpu/gpu_text_model.h"

namespace deltamoe {

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

}  // namespace deltamoe
