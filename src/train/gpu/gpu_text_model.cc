// GpuTextModel: construction, parameter upload, planning of activations and workspaces, batch
// upload and the optimizer step. The forward and backward schedules are in gpu_text_model_step.cc.
#include "train/gpu/gpu_text_model.h"

#include <algorithm>
#include <cmath>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/attention/attention.h"
#include "kernels/attention/attention_cuda.h"
#include "kernels/cross_entropy/cross_entropy_cuda.h"
#include "kernels/gated_delta_rule/gated_delta_rule_cuda.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/moe_aux_loss/moe_aux_loss_cuda.h"
#include "kernels/moe_experts/moe_experts_cuda.h"
#include "kernels/mrope/mrope_cuda.h"
#include "kernels/rms_norm/rms_norm_cuda.h"
#include "kernels/shared_expert/shared_expert_cuda.h"
#include "model/text/text_batch.h"
#include "optim/adamw_cuda.h"
#include "train/gpu/arena_carver.h"
#include "train/gpu/gpu_layer_buffers.h"
#include "train/gpu/param_init.h"

namespace deltamoe {

namespace {

using Carver = ArenaCarver;

// Lays out every activation of the step for `T` tokens.
void carve_layers(Carver& c, const TextConfig& cfg, int64_t T, bool share_mixer_state,
                  std::vector<GpuLayerBuffers>* layers, GpuScratch* scratch) {
  const GdnSaved* first_gdn = nullptr;
  const AttentionSaved* first_attn = nullptr;
  const int64_t C = cfg.hidden_size, E = cfg.num_experts, K = cfg.num_experts_per_tok;
  const int64_t kd = cfg.key_dim(), vd = cfg.value_dim(), conv = cfg.conv_dim(), Hv = cfg.linear_num_value_heads;
  const int64_t Hq = cfg.num_attention_heads, Hkv = cfg.num_key_value_heads, D = cfg.head_dim;
  layers->assign(static_cast<size_t>(cfg.num_hidden_layers), GpuLayerBuffers{});
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    GpuLayerBuffers& b = (*layers)[static_cast<size_t>(i)];
    b.is_gdn = cfg.layer_types[static_cast<size_t>(i)] == LayerType::linear_attention;
    b.x_in = i == 0 ? nullptr : c.take<float>(T * C);  // layer 0 reads the embedding (set by the caller)
    b.normed_in = c.take<DeviceBf16>(T * C);
    b.rstd_in = c.take<float>(T);
    b.mixer_out = c.take<DeviceBf16>(T * C);
    b.h = c.take<float>(T * C);
    b.normed_post = c.take<DeviceBf16>(T * C);
    b.rstd_post = c.take<float>(T);
    b.moe_out = c.take<DeviceBf16>(T * C);
    if (b.is_gdn && share_mixer_state && first_gdn != nullptr) {
      b.gdn = *first_gdn;  // recomputed before the backward: every GDN layer uses one set
    } else if (!b.is_gdn && share_mixer_state && first_attn != nullptr) {
      b.attn = *first_attn;
    } else if (b.is_gdn) {
      GdnSaved& g = b.gdn;
      g.mixed = c.take<DeviceBf16>(T * conv);
      g.z = c.take<DeviceBf16>(T * vd);
      g.a = c.take<float>(T * Hv);
      g.b = c.take<float>(T * Hv);
      g.q = c.take<DeviceBf16>(T * kd);
      g.k = c.take<DeviceBf16>(T * kd);
      g.v = c.take<DeviceBf16>(T * vd);
      g.q_normed = c.take<DeviceBf16>(T * kd);
      g.k_normed = c.take<DeviceBf16>(T * kd);
      g.g = c.take<float>(T * Hv);
      g.beta = c.take<float>(T * Hv);
      g.core = c.take<DeviceBf16>(T * vd);
      g.normed = c.take<DeviceBf16>(T * vd);
      first_gdn = &g;
    } else {
      AttentionSaved& a = b.attn;
      a.q_and_gate = c.take<DeviceBf16>(T * Hq * 2 * D);
      a.k_raw = c.take<DeviceBf16>(T * Hkv * D);
      a.v = c.take<DeviceBf16>(T * Hkv * D);
      a.q = c.take<DeviceBf16>(T * Hq * D);
      a.k = c.take<DeviceBf16>(T * Hkv * D);
      a.q_rstd = c.take<float>(T * Hq);
      a.k_rstd = c.take<float>(T * Hkv);
      a.attn = c.take<DeviceBf16>(T * Hq * D);
      a.lse = c.take<float>(T * Hq);
      a.gated = c.take<DeviceBf16>(T * Hq * D);
      first_attn = &a;
    }
    MoeSaved& m = b.moe;
    m.logits = c.take<float>(T * E);
    m.probs = c.take<float>(T * E);
    m.topk_idx = c.take<int32_t>(T * K);
    m.topk_weight = c.take<float>(T * K);
    m.plan_memory = c.take_bytes(moe_routing_plan_bytes(T, E, K));
  }
  // Temporaries of one layer at a time (forward conv output and every backward intermediate).
  const bool any_gdn = cfg.num_layers_of(LayerType::linear_attention) > 0;
  const bool any_attn = cfg.num_layers_of(LayerType::full_attention) > 0;
  GpuScratch& s = *scratch;
  if (any_gdn) {
    s.conv = c.take<DeviceBf16>(T * conv);
    s.d_normed_v = c.take<DeviceBf16>(T * vd);
    s.d_core = c.take<DeviceBf16>(T * vd);
    s.dz = c.take<DeviceBf16>(T * vd);
    s.dq_normed = c.take<DeviceBf16>(T * kd);
    s.dk_normed = c.take<DeviceBf16>(T * kd);
    s.dv = c.take<DeviceBf16>(T * vd);
    s.dg = c.take<float>(T * Hv);
    s.dbeta = c.take<float>(T * Hv);
    s.da = c.take<float>(T * Hv);
    s.db = c.take<float>(T * Hv);
    s.d_conv = c.take<DeviceBf16>(T * conv);
    s.d_mixed = c.take<DeviceBf16>(T * conv);
  }
  if (any_attn) {
    s.d_gated = c.take<DeviceBf16>(T * Hq * D);
    s.d_q_and_gate = c.take<DeviceBf16>(T * Hq * 2 * D);
    s.dq = c.take<DeviceBf16>(T * Hq * D);
    s.dk = c.take<DeviceBf16>(T * Hkv * D);
    s.dv_attn = c.take<DeviceBf16>(T * Hkv * D);
    s.dk_raw = c.take<DeviceBf16>(T * Hkv * D);
  }
  s.d_topk_weight = c.take<float>(T * K);
  s.d_logits = c.take<float>(T * E);
  const int64_t gate_width = any_gdn ? std::max(Hv, E) : E;
  s.gate_grad_hi = c.take<DeviceBf16>(T * gate_width);
  s.gate_grad_lo = c.take<DeviceBf16>(T * gate_width);
  s.router_x_lo = c.take<DeviceBf16>(T * cfg.hidden_size);
  s.router_w_hi = c.take<DeviceBf16>(E * cfg.hidden_size);
  s.router_w_lo = c.take<DeviceBf16>(E * cfg.hidden_size);
  s.d_mixer_input_f32 = c.take<float>(T * cfg.hidden_size);
}

GatedDeltaRuleShape rule_shape_for(const TextConfig& cfg, int64_t T, int64_t num_seqs, const int32_t* cu_seqlens) {
  GatedDeltaRuleShape shape;
  shape.cu_seqlens = cu_seqlens;
  shape.num_seqs = static_cast<int>(num_seqs);
  shape.num_tokens = T;
  shape.num_key_heads = static_cast<int>(cfg.linear_num_key_heads);
  shape.num_value_heads = static_cast<int>(cfg.linear_num_value_heads);
  shape.key_dim = static_cast<int>(cfg.linear_key_head_dim);
  shape.value_dim = static_cast<int>(cfg.linear_value_head_dim);
  return shape;
}

// The largest workspace any kernel of the step asks for (they run one at a time on one stream).
size_t step_workspace_bytes(const TextConfig& cfg, int64_t T, int64_t num_seqs, int64_t loss_chunk_rows) {
  const int64_t C = cfg.hidden_size, E = cfg.num_experts, K = cfg.num_experts_per_tok;
  const int64_t Hq = cfg.num_attention_heads, Hkv = cfg.num_key_value_heads, D = cfg.head_dim;
  size_t bytes = 256;
  auto need = [&](size_t b) { bytes = std::max(bytes, b); };
  need(rms_norm_backward_workspace_bytes(T, C));
  need(rms_norm_backward_workspace_bytes(T * Hq, D));
  need(rms_norm_backward_workspace_bytes(T * Hkv, D));
  need(attention_backward_workspace_bytes(AttentionDims{T, Hq, Hkv, D}));
  const GatedDeltaRuleShape rule = rule_shape_for(cfg, T, num_seqs, nullptr);
  need(gated_delta_rule_forward_workspace_bytes(rule));
  need(gated_delta_rule_backward_workspace_bytes(rule));
  const MoeExpertsDims dims{T, C, E, K, cfg.moe_intermediate_size};
  need(moe_experts_forward_workspace_bytes(dims));
  need(moe_experts_backward_workspace_bytes(dims));
  need(shared_expert_forward_workspace_bytes(T, C, cfg.shared_expert_intermediate_size));
  need(shared_expert_backward_workspace_bytes(T, C, cfg.shared_expert_intermediate_size));
  need(moe_aux_loss_accumulate_workspace_bytes(T, E));
  need(lm_head_cross_entropy_workspace_bytes(std::min(loss_chunk_rows, T), cfg.vocab_size));
  return bytes;
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

GpuTextModel::GpuTextModel(const TextConfig& config, std::string prefix, const GpuModelOptions& options)
    : config_(config), prefix_(std::move(prefix)), options_(options) {
  CHECK(options_.max_tokens >= 1, "gpu model: the token budget must be positive, got ", options_.max_tokens);
  CHECK(options_.max_seqs >= 1, "gpu model: max_seqs must be positive, got ", options_.max_seqs);
  CHECK(options_.loss_chunk_rows >= 1, "gpu model: the loss chunk must be positive, got ", options_.loss_chunk_rows);
  CHECK(options_.max_image_rows >= -1 && options_.max_image_rows <= options_.max_tokens,
        "gpu model: max_image_rows must be -1 (the token budget) or 0..", options_.max_tokens, ", got ",
        options_.max_image_rows);
  max_image_rows_ = options_.max_image_rows < 0 ? options_.max_tokens : options_.max_image_rows;
  CHECK(!config_.tie_word_embeddings, "gpu model: tied word embeddings are not supported yet");
  validate_adamw_config(options_.adamw);
  for (const NamedShape& named : text_param_shapes(config_, prefix_)) {
    // Zero-centred norm weights, A_log and dt_bias are 1-D: no decay, as in the CPU trainer.
    layout_.add(named.name, named.shape);
  }
  const int64_t n = layout_.total_numel();
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CUBLAS_CHECK(cublasCreate(&cublas_));
  CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
  // bf16 products through this handle (router logits, shared expert) add split-K parts in fp32 only,
  // as the cuBLASLt ones do (GemmContext).
  CUBLAS_CHECK(cublasSetMathMode(
      cublas_, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  gemm_ = std::make_unique<GemmContext>();
  master_ = DeviceBuffer(static_cast<size_t>(n) * sizeof(float));
  grads_ = DeviceBuffer(static_cast<size_t>(n) * sizeof(float));
  const size_t moment_bytes = static_cast<size_t>(n) * dtype_size(options_.adamw.moment_dtype);
  moment_m_ = DeviceBuffer(moment_bytes);
  moment_v_ = DeviceBuffer(moment_bytes);
  weights_bf16_ = DeviceBuffer(static_cast<size_t>(n) * sizeof(DeviceBf16));
  // Moments and padding start at zero (zero gradient keeps padding zero under AdamW).
  CUDA_CHECK(cudaMemsetAsync(master_.data(), 0, master_.bytes(), stream_));
  CUDA_CHECK(cudaMemsetAsync(grads_.data(), 0, grads_.bytes(), stream_));
  CUDA_CHECK(cudaMemsetAsync(moment_m_.data(), 0, moment_bytes, stream_));
  CUDA_CHECK(cudaMemsetAsync(moment_v_.data(), 0, moment_bytes, stream_));
  CUDA_CHECK(cudaMemsetAsync(weights_bf16_.data(), 0, weights_bf16_.bytes(), stream_));
  plan_activations();
  timer_.set_enabled(options_.time_components);
}

GpuTextModel::~GpuTextModel() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  gemm_.reset();
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void GpuTextModel::plan_activations() {
  const int64_t T = options_.max_tokens, C = config_.hidden_size;
  // One function lays everything out; run once counting bytes, once over the sized arena.
  auto carve_all = [&](Carver& carver, std::vector<GpuLayerBuffers>* layers, GpuScratch* scratch) {
    carve_layers(carver, config_, T, options_.recompute_mixers, layers, scratch);
    embedded_ = carver.take<float>(T * C);
    if (!layers->empty()) layers->front().x_in = embedded_;
    final_hidden_ = carver.take<float>(T * C);
    final_normed_ = carver.take<DeviceBf16>(T * C);
    final_rstd_ = carver.take<float>(T);
    grad_stream_ = carver.take<float>(T * C);
    grad_stream_bf16_ = carver.take<DeviceBf16>(T * C);
    grad_mixer_ = carver.take<float>(T * C);
    grad_mixer_bf16_ = carver.take<DeviceBf16>(T * C);
    grad_normed_ = carver.take<DeviceBf16>(T * C);
    image_rows_ = carver.take<int32_t>(max_image_rows_);
    image_embeds_ = carver.take<DeviceBf16>(max_image_rows_ * C);
    image_grads_ = carver.take<DeviceBf16>(max_image_rows_ * C);
    captured_grads_.clear();
    if (options_.capture_layer_grads)
      for (int64_t k = 0; k < 3 * config_.num_hidden_layers; ++k) captured_grads_.push_back(carver.take<float>(T * C));
  };
  Carver counter(nullptr);
  GpuScratch unused_scratch;
  std::vector<GpuLayerBuffers> unused_layers;
  carve_all(counter, &unused_layers, &unused_scratch);
  activation_bytes_ = counter.used();
  arena_ = std::make_unique<DeviceArena>(activation_bytes_, "gpu model activations");
  Carver carver(arena_.get());
  scratch_ = std::make_unique<GpuScratch>();
  carve_all(carver, &layers_, scratch_.get());
  const TextConfig& c = config_;

  workspace_bytes_ = step_workspace_bytes(c, T, options_.max_seqs, options_.loss_chunk_rows);
  workspace_ = DeviceBuffer(workspace_bytes_);

  // Batch inputs and loss scalars.
  const int64_t half_rotary = text_rotary_dim(c) / 2;
  auto round_up = [](size_t b) { return (b + 255) / 256 * 256; };
  size_t offset = 0;
  const size_t ids_at = offset;
  offset += round_up(static_cast<size_t>(T) * 8);
  const size_t labels_at = offset;
  offset += round_up(static_cast<size_t>(T) * 8);
  const size_t cu_at = offset;
  offset += round_up(static_cast<size_t>(options_.max_seqs + 1) * 4);
  const size_t positions_at = offset;
  offset += round_up(static_cast<size_t>(3 * T) * 8);
  const size_t cos_at = offset;
  offset += round_up(static_cast<size_t>(T * std::max<int64_t>(half_rotary, 1)) * 4);
  const size_t sin_at = offset;
  offset += round_up(static_cast<size_t>(T * std::max<int64_t>(half_rotary, 1)) * 4);
  const size_t token_loss_at = offset;
  offset += round_up(static_cast<size_t>(T) * 4);
  const size_t lse_at = offset;
  offset += round_up(static_cast<size_t>(T) * 4);
  const size_t loss_at = offset;
  offset += 256;
  const size_t aux_at = offset;
  offset += 256;
  const size_t counts_at = offset;
  offset += round_up(static_cast<size_t>(c.num_experts) * 8);
  const size_t probs_at = offset;
  offset += round_up(static_cast<size_t>(c.num_experts) * 8);
  inputs_bytes_ = offset;
  inputs_ = DeviceBuffer(inputs_bytes_);
  char* base = inputs_.as<char>();
  ids_ = reinterpret_cast<int64_t*>(base + ids_at);
  labels_ = reinterpret_cast<int64_t*>(base + labels_at);
  cu_seqlens_ = reinterpret_cast<int32_t*>(base + cu_at);
  positions_ = reinterpret_cast<int64_t*>(base + positions_at);
  rope_cos_ = reinterpret_cast<float*>(base + cos_at);
  rope_sin_ = reinterpret_cast<float*>(base + sin_at);
  token_loss_ = reinterpret_cast<float*>(base + token_loss_at);
  lse_ = reinterpret_cast<float*>(base + lse_at);
  loss_ = reinterpret_cast<float*>(base + loss_at);
  aux_loss_ = reinterpret_cast<double*>(base + aux_at);
  aux_counts_ = reinterpret_cast<double*>(base + counts_at);
  aux_probs_ = reinterpret_cast<double*>(base + probs_at);
  CUDA_CHECK(cudaMemsetAsync(inputs_.data(), 0, inputs_bytes_, stream_));
}

int64_t GpuTextModel::offset_of(int64_t layer, const std::string& name) const {
  const std::string full = layer >= 0 ? layer_prefix(prefix_, layer) + name : name;
  const int index = layout_.find(full);
  CHECK(index >= 0, "gpu model: no parameter '", full, "' in the layout");
  return layout_.entry(index).offset;
}

const DeviceBf16* GpuTextModel::weight(int64_t layer, const std::string& name) const {
  return weights_bf16_.as<DeviceBf16>() + offset_of(layer, name);
}
float* GpuTextModel::master(int64_t layer, const std::string& name) const {
  return master_.as<float>() + offset_of(layer, name);
}
float* GpuTextModel::grad(int64_t layer, const std::string& name) const {
  return grads_.as<float>() + offset_of(layer, name);
}

void GpuTextModel::upload_params(const ParamMap& params) {
  check_text_params(params, config_, prefix_);
  for (const ParamEntry& entry : layout_.entries()) {
    const ParamTensor& tensor = params.at(entry.name);
    CUDA_CHECK(cudaMemcpyAsync(master_.as<float>() + entry.offset, tensor.values.data(),
                               static_cast<size_t>(entry.numel) * sizeof(float), cudaMemcpyHostToDevice, stream_));
  }
  convert_f32_to_bf16_cuda(master_.as<float>(), weights_bf16_.as<DeviceBf16>(), layout_.total_numel(), stream_);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void GpuTextModel::randomize_params(uint64_t seed, float matrix_std) {
  for (int i = 0; i < layout_.num_tensors(); ++i) {
    const ParamEntry& e = layout_.entry(i);
    // Matrices random; 1-D tensors constant: zero-centred norms 0 (scale 1), the GDN norm weight
    // (a plain RMSNorm weight) and dt_bias 1; A_log random around 1 (decay rates exp(A_log) near e).
    float mean = 0.0f, std = e.shape.size() >= 2 ? matrix_std : 0.0f;
    if (ends_with(e.name, "linear_attn.norm.weight") || ends_with(e.name, "dt_bias")) mean = 1.0f;
    if (ends_with(e.name, "A_log")) mean = 1.0f, std = 0.5f;
    fill_normal_cuda(master_.as<float>() + e.offset, e.numel, mean, std, seed, static_cast<uint64_t>(i), stream_);
  }
  convert_f32_to_bf16_cuda(master_.as<float>(), weights_bf16_.as<DeviceBf16>(), layout_.total_numel(), stream_);
}

void GpuTextModel::set_batch(const std::vector<int64_t>& ids, const std::vector<int64_t>& shifted_labels,
                             const std::vector<int32_t>& cu_seqlens, const std::vector<int64_t>& positions) {
  const int64_t T = static_cast<int64_t>(ids.size());
  CHECK(T >= 1 && T <= options_.max_tokens, "gpu model: a batch of ", T, " tokens, the model was planned for 1..",
        options_.max_tokens);
  CHECK(static_cast<int64_t>(shifted_labels.size()) == T, "gpu model: ", shifted_labels.size(), " labels for ", T,
        " tokens");
  const int64_t N = static_cast<int64_t>(cu_seqlens.size()) - 1;
  CHECK(N >= 1 && N <= options_.max_seqs, "gpu model: ", N, " sequences, the model was planned for 1..",
        options_.max_seqs);
  for (int64_t id : ids)
    CHECK(id >= 0 && id < config_.vocab_size, "gpu model: token id ", id, " outside the vocabulary [0, ",
          config_.vocab_size, ")");
  // Validates cu_seqlens and positions and builds the rope tables exactly as the CPU model does.
  TextBatch batch = make_text_batch(config_, T, cu_seqlens, positions);
  num_tokens_ = T;
  num_seqs_ = N;
  host_cu_seqlens_ = cu_seqlens;
  num_supervised_ = 0;
  for (int64_t label : shifted_labels) {
    CHECK(label == -100 || (label >= 0 && label < config_.vocab_size), "gpu model: label ", label,
          " outside the vocabulary (and not -100)");
    if (label != -100) ++num_supervised_;
  }
  CHECK(step_workspace_bytes(config_, T, N, options_.loss_chunk_rows) <= workspace_bytes_,
        "gpu model: this batch needs more workspace than planned");
  CUDA_CHECK(cudaMemcpyAsync(ids_, ids.data(), static_cast<size_t>(T) * 8, cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaMemcpyAsync(labels_, shifted_labels.data(), static_cast<size_t>(T) * 8, cudaMemcpyHostToDevice,
                             stream_));
  CUDA_CHECK(cudaMemcpyAsync(cu_seqlens_, cu_seqlens.data(), static_cast<size_t>(N + 1) * 4, cudaMemcpyHostToDevice,
                             stream_));
  CUDA_CHECK(cudaMemcpyAsync(positions_, batch.positions.data(), static_cast<size_t>(3 * T) * 8,
                             cudaMemcpyHostToDevice, stream_));
  // The same fp32 tables as the CPU reference (host-built), so the GPU rotation sees equal angles.
  CUDA_CHECK(cudaMemcpyAsync(rope_cos_, batch.rope_cos.data(), batch.rope_cos.size() * 4, cudaMemcpyHostToDevice,
                             stream_));
  CUDA_CHECK(cudaMemcpyAsync(rope_sin_, batch.rope_sin.data(), batch.rope_sin.size() * 4, cudaMemcpyHostToDevice,
                             stream_));
  rope_ = batch.rope;
  for (GpuLayerBuffers& layer : layers_)
    layer.moe.plan = moe_routing_plan_in(layer.moe.plan_memory, T, config_.num_experts, config_.num_experts_per_tok);
  // Pageable host memory: wait for the copies so the caller may free its vectors.
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void GpuTextModel::set_image_rows(const std::vector<int32_t>& rows) {
  const int64_t M = static_cast<int64_t>(rows.size());
  CHECK(M <= max_image_rows_, "gpu model: ", M, " image-token rows, the model was planned for at most ",
        max_image_rows_, " (GpuModelOptions::max_image_rows)");
  for (int64_t i = 0; i < M; ++i) {
    const int32_t row = rows[static_cast<size_t>(i)];
    CHECK(row >= 0 && row < options_.max_tokens, "gpu model: image-token row ", i, " is ", row,
          ", outside the token budget [0, ", options_.max_tokens, ")");
    CHECK(i == 0 || row > rows[static_cast<size_t>(i - 1)], "gpu model: image-token rows must be strictly increasing (",
          "row ", i, " is ", row, " after ", rows[static_cast<size_t>(std::max<int64_t>(i - 1, 0))], ")");
  }
  num_image_rows_ = M;
  last_image_row_ = M > 0 ? rows.back() : -1;
  if (M == 0) return;
  CUDA_CHECK(cudaMemcpyAsync(image_rows_, rows.data(), static_cast<size_t>(M) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream_));
  // Pageable host memory: wait for the copy so the caller may free its vector.
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void GpuTextModel::optimizer_step(double lr, int64_t adam_step) {
  timer_.mark(StepComponent::optimizer, stream_);
  adamw_step_cuda(layout_, options_.adamw, layout_.whole(), lr, adam_step, master_.as<float>(), grads_.as<float>(),
                  moment_m_.data(), moment_v_.data(), weights_bf16_.as<DeviceBf16>(), stream_);
}

float GpuTextModel::read_loss() const {
  float loss = 0.0f;
  CUDA_CHECK(cudaMemcpyAsync(&loss, loss_, sizeof(float), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return loss;
}

double GpuTextModel::read_aux_loss() const {
  double aux = 0.0;
  CUDA_CHECK(cudaMemcpyAsync(&aux, aux_loss_, sizeof(double), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return aux;
}

namespace {
std::vector<float> download(const float* device, int64_t count, cudaStream_t stream) {
  std::vector<float> host(static_cast<size_t>(count));
  CUDA_CHECK(cudaMemcpyAsync(host.data(), device, host.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}
}  // namespace

std::vector<float> GpuTextModel::read_gradient(const std::string& name) const {
  const int index = layout_.find(name);
  CHECK(index >= 0, "gpu model: no parameter '", name, "'");
  const ParamEntry& e = layout_.entry(index);
  return download(grads_.as<float>() + e.offset, e.numel, stream_);
}

std::vector<float> GpuTextModel::read_master(const std::string& name) const {
  const int index = layout_.find(name);
  CHECK(index >= 0, "gpu model: no parameter '", name, "'");
  const ParamEntry& e = layout_.entry(index);
  return download(master_.as<float>() + e.offset, e.numel, stream_);
}

std::vector<int32_t> GpuTextModel::read_topk_idx(int64_t layer) const {
  CHECK(layer >= 0 && layer < config_.num_hidden_layers, "gpu model: no decoder layer ", layer);
  std::vector<int32_t> host(static_cast<size_t>(num_tokens_ * config_.num_experts_per_tok));
  CUDA_CHECK(cudaMemcpyAsync(host.data(), layers_[static_cast<size_t>(layer)].moe.topk_idx, host.size() * 4,
                             cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return host;
}

std::vector<float> GpuTextModel::read_layer_activation(int64_t layer, LayerActivation which) const {
  CHECK(layer >= 0 && layer < config_.num_hidden_layers, "gpu model: no decoder layer ", layer);
  const GpuLayerBuffers& b = layers_[static_cast<size_t>(layer)];
  const int64_t T = num_tokens_, C = config_.hidden_size;
  if (which == LayerActivation::router_probs) return download(b.moe.probs, T * config_.num_experts, stream_);
  if (which == LayerActivation::input) return download(b.x_in, T * C, stream_);
  if (which == LayerActivation::after_mixer) return download(b.h, T * C, stream_);
  const DeviceBf16* source = which == LayerActivation::mixer_input ? b.normed_in : b.normed_post;
  std::vector<uint16_t> bits(static_cast<size_t>(T * C));
  CUDA_CHECK(cudaMemcpyAsync(bits.data(), source, bits.size() * 2, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::vector<float> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) values[i] = bf16_bits_to_float(bits[i]);
  return values;
}

void GpuTextModel::capture_gradient(int64_t layer, LayerGradient which, const float* source) {
  if (captured_grads_.empty()) return;
  float* slot = captured_grads_[static_cast<size_t>(layer * 3 + static_cast<int64_t>(which))];
  CUDA_CHECK(cudaMemcpyAsync(slot, source, static_cast<size_t>(num_tokens_ * config_.hidden_size) * sizeof(float),
                             cudaMemcpyDeviceToDevice, stream_));
}

std::vector<float> GpuTextModel::read_layer_gradient(int64_t layer, LayerGradient which) const {
  CHECK(layer >= 0 && layer < config_.num_hidden_layers, "gpu model: no decoder layer ", layer);
  CHECK(!captured_grads_.empty(), "gpu model: layer gradients were not captured (set options.capture_layer_grads)");
  const float* source = captured_grads_[static_cast<size_t>(layer * 3 + static_cast<int64_t>(which))];
  return download(source, num_tokens_ * config_.hidden_size, stream_);
}

GpuMemoryBreakdown GpuTextModel::memory() const {
  GpuMemoryBreakdown m;
  m.weights = master_.bytes() + weights_bf16_.bytes();
  m.gradients = grads_.bytes();
  m.optimizer = moment_m_.bytes() + moment_v_.bytes();
  m.activations = activation_bytes_;
  m.workspace = workspace_bytes_ + inputs_bytes_ + gemm_->workspace_bytes();
  return m;
}

}  // namespace deltamoe
