// GpuTextModel: construction, planning of activations, workspaces and inputs, the staged batch
// upload, and the readbacks for tests. The forward and backward schedules are in
// gpu_text_model_step.cc, the mixers and the MoE block in gpu_gdn_layer.cc, gpu_attention_layer.cc
// and gpu_moe_block.cc.
#include "model/text/gpu/gpu_text_model.h"
#include "model/text/gpu/gpu_expert_parallel.h"

#include <algorithm>
#include <cmath>

#include "core/cuda_check.h"
#include "core/device_alloc.h"
#include "core/error.h"
#include "kernels/attention/attention.h"
#include "kernels/attention/attention_cuda.h"
#include "kernels/causal_conv1d/causal_conv1d_cuda.h"
#include "kernels/cross_entropy/cross_entropy_cuda.h"
#include "kernels/cudnn_sdpa/gpu/cudnn_attention_choice.h"
#include "kernels/embedding/embedding_grad_plan.h"
#include "kernels/gated_delta_rule/gated_delta_rule_cuda.h"
#include "kernels/gated_rmsnorm/gated_rmsnorm_cuda.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/moe_aux_loss/moe_aux_loss_cuda.h"
#include "kernels/rms_norm/rms_norm_cuda.h"
#include "kernels/shared_expert/shared_expert_cuda.h"
#include "model/text/expert_exchange_size.h"
#include "model/text/text_batch.h"

namespace deltamoe {

namespace {

GatedDeltaRuleShape rule_shape_for(const TextConfig& cfg, int64_t T, int64_t num_seqs) {
  GatedDeltaRuleShape shape;
  shape.num_seqs = static_cast<int>(num_seqs);
  shape.num_tokens = T;
  shape.num_key_heads = static_cast<int>(cfg.linear_num_key_heads);
  shape.num_value_heads = static_cast<int>(cfg.linear_num_value_heads);
  shape.key_dim = static_cast<int>(cfg.linear_key_head_dim);
  shape.value_dim = static_cast<int>(cfg.linear_value_head_dim);
  return shape;
}

// The full-attention layers' cuDNN SDPA plans: causal GQA over up to max_tokens in max_seqs.
CudnnSdpaConfig cudnn_attention_config(const TextConfig& cfg, int64_t max_tokens, int64_t max_seqs) {
  CudnnSdpaConfig c;
  c.max_tokens = max_tokens;
  c.max_segments = max_seqs;
  c.num_q_heads = cfg.num_attention_heads;
  c.num_kv_heads = cfg.num_key_value_heads;
  c.head_dim = cfg.head_dim;
  c.causal = true;
  c.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(cfg.head_dim)));
  return c;
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
  if (cfg.num_layers_of(LayerType::full_attention) > 0)
    need(cudnn_attention_workspace_reserve(cudnn_attention_config(cfg, T, num_seqs)));
  if (cfg.num_layers_of(LayerType::linear_attention) > 0) {
    const GatedDeltaRuleShape rule = rule_shape_for(cfg, T, num_seqs);
    need(gated_delta_rule_forward_workspace_bytes(rule));
    need(gated_delta_rule_backward_workspace_bytes(rule));
    need(causal_conv1d_backward_workspace_bytes(T, static_cast<int>(cfg.conv_dim()),
                                                static_cast<int>(cfg.linear_conv_kernel_dim)));
    need(gated_rmsnorm_backward_workspace_bytes(T * cfg.linear_num_value_heads,
                                                static_cast<int>(cfg.linear_value_head_dim)));
  }
  const MoeExpertsDims dims{T, C, E, K, cfg.moe_intermediate_size};
  need(moe_experts_forward_workspace_bytes(dims));
  need(moe_experts_backward_workspace_bytes(dims));
  need(shared_expert_forward_workspace_bytes(T, C, cfg.shared_expert_intermediate_size));
  need(shared_expert_backward_workspace_bytes(T, C, cfg.shared_expert_intermediate_size));
  need(moe_aux_loss_accumulate_workspace_bytes(T, E));
  need(lm_head_cross_entropy_workspace_bytes(std::min(loss_chunk_rows, T), cfg.vocab_size, C));
  return bytes;
}

TextActivationSpec activation_spec(const TextConfig& config, const GpuModelOptions& options) {
  CHECK(options.max_tokens >= 1, "gpu model: the token budget must be positive, got ", options.max_tokens);
  CHECK(options.max_seqs >= 1, "gpu model: max_seqs must be positive, got ", options.max_seqs);
  CHECK(options.loss_chunk_rows >= 1, "gpu model: the loss chunk must be positive, got ", options.loss_chunk_rows);
  CHECK(options.max_image_rows >= -1 && options.max_image_rows <= options.max_tokens,
        "gpu model: max_image_rows must be -1 (the token budget) or 0..", options.max_tokens, ", got ",
        options.max_image_rows);
  TextActivationSpec spec;
  spec.max_tokens = options.max_tokens;
  spec.max_seqs = options.max_seqs;
  spec.max_image_rows = options.max_image_rows < 0 ? options.max_tokens : options.max_image_rows;
  CHECK(options.recompute_layers >= 0 && options.recompute_layers <= config.num_hidden_layers,
        "gpu model: recompute_layers must be 0..", config.num_hidden_layers, " (the decoder layers), got ",
        options.recompute_layers);
  spec.share_mixer_state = options.recompute_mixers;
  spec.recompute_layers = options.recompute_layers;
  CHECK(!options.keep_expert_rows || options.expert_parallel == nullptr,
        "gpu model: the experts' rows are kept only when every expert is on this rank");
  spec.keep_expert_rows = options.keep_expert_rows;
  spec.keep_gdn_forward = options.keep_gdn_forward;
  spec.capture_layer_grads = options.capture_layer_grads;
  return spec;
}

}  // namespace

GatedDeltaRuleShape GpuTextModel::gdn_rule_shape() const {
  GatedDeltaRuleShape shape = rule_shape_for(config_, num_tokens_, num_seqs_);
  shape.cu_seqlens = inputs_.cu_seqlens;
  return shape;
}

// Pinned host copies of one micro-batch's inputs, laid out as on the device, and the event after
// which the stream has read them.
struct GpuTextModel::Staging {
  void* block = nullptr;
  size_t bytes = 0;
  TextInputs host;          // the same layout in pinned memory
  int32_t* image_rows = nullptr;
  cudaEvent_t consumed = nullptr;
  ~Staging() {
    if (consumed != nullptr) cudaEventDestroy(consumed);
    if (block != nullptr) cudaFreeHost(block);
  }
};

GpuModelBytes GpuTextModel::planned_bytes(const TextConfig& config, const GpuModelOptions& options) {
  const TextActivationSpec spec = activation_spec(config, options);
  GpuModelBytes bytes;
  bytes.activations = text_activation_bytes(config, spec);
  bytes.workspace = step_workspace_bytes(config, spec.max_tokens, spec.max_seqs, options.loss_chunk_rows) +
                    kGemmDefaultWorkspaceBytes;
  bytes.inputs = text_input_bytes(config, spec);
  if (options.lora_rank > 0) {
    // The dense adapters' x A^T / dy B rows and the routed-expert adapters' workspace (as the
    // constructor allocates them when the weights carry such adapters).
    const MoeExpertsDims dims{spec.max_tokens, config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size};
    bytes.workspace += shared_expert_lora_scratch_bytes(spec.max_tokens, options.lora_rank) +
                       moe_experts_lora_workspace_bytes(dims, options.lora_rank);
  }
  if (options.lora_dropout_max_in > 0) {
    bytes.workspace += lora_dropout_scratch_bytes(spec.max_tokens, options.lora_dropout_max_in);
  }
  if (options.expert_parallel != nullptr) {
    bytes.workspace += expert_exchange_bytes(config, options.expert_parallel->size(), spec.max_tokens,
                                             options.expert_recv_rows);
  }
  return bytes;
}

GpuTextModel::GpuTextModel(const TextConfig& config, const TextWeights& weights, const GpuModelOptions& options,
                           cudaStream_t stream)
    : config_(config), weights_(weights), options_(options), stream_(stream) {
  CHECK(!config_.tie_word_embeddings, "gpu model: tied word embeddings are not supported yet");
  CHECK(static_cast<int64_t>(weights_.layers.size()) == config_.num_hidden_layers, "gpu model: ",
        weights_.layers.size(), " bound layers for ", config_.num_hidden_layers);
  spec_ = activation_spec(config_, options_);
  max_image_rows_ = spec_.max_image_rows;
  // Every dense product of the model (the router's and the shared expert's included) goes through
  // this one context: its workspace, and its algorithm per token-count bucket, so a micro-batch of
  // a new length neither queries cuBLASLt nor loads a kernel nor takes device memory.
  gemm_ = std::make_unique<GemmContext>();

  bytes_ = planned_bytes(config_, options_);
  arena_ = std::make_unique<DeviceArena>(bytes_.activations, "gpu text model activations");
  ArenaCarver carver(arena_.get());
  carve_text_activations(carver, config_, spec_, &acts_);
  workspace_bytes_ = bytes_.workspace - kGemmDefaultWorkspaceBytes;
  if (options_.lora_rank > 0) {
    // Planned above, allocated below on their own (from what the bound weights carry).
    const MoeExpertsDims dims{spec_.max_tokens, config_.hidden_size, config_.num_experts, config_.num_experts_per_tok,
                              config_.moe_intermediate_size};
    workspace_bytes_ -= shared_expert_lora_scratch_bytes(spec_.max_tokens, options_.lora_rank) +
                        moe_experts_lora_workspace_bytes(dims, options_.lora_rank);
  }
  if (options_.lora_dropout_max_in > 0) {
    // Planned above, allocated on its own: dropping adapters' x' and masked input gradient.
    const size_t dropout_bytes = lora_dropout_scratch_bytes(spec_.max_tokens, options_.lora_dropout_max_in);
    workspace_bytes_ -= dropout_bytes;
    lora_dropout_scratch_ = DeviceBuffer(dropout_bytes);
  }
  if (options_.expert_parallel != nullptr) {
    CHECK(config_.num_experts % options_.expert_parallel->size() == 0, "gpu model: ", config_.num_experts,
          " experts do not split over ", options_.expert_parallel->size(), " expert-parallel ranks");
    workspace_bytes_ -= expert_exchange_bytes(config_, options_.expert_parallel->size(), spec_.max_tokens,
                                              options_.expert_recv_rows);
    expert_parallel_ = std::make_unique<GpuExpertParallel>(*options_.expert_parallel, config_, spec_.max_tokens,
                                                           options_.expert_recv_rows, stream_);
    shared_expert_pending_ = DeviceBuffer(shared_expert_pending_bytes(spec_.max_tokens, config_.hidden_size));
    // The expert stacks are bound as this rank's experts only ([E_local, 2I, C], [E_local, C, I]).
    const int64_t local = config_.num_experts / options_.expert_parallel->size();
    const int64_t C = config_.hidden_size, I = config_.moe_intermediate_size;
    for (size_t l = 0; l < weights_.layers.size(); ++l) {
      const MoeWeights& mlp = weights_.layers[l].mlp;
      CHECK(mlp.experts_gate_up.numel == local * 2 * I * C && mlp.experts_down.numel == local * C * I,
            "gpu model: layer ", l, "'s routed experts are bound with ", mlp.experts_gate_up.numel, " + ",
            mlp.experts_down.numel, " elements; with ", options_.expert_parallel->size(),
            " expert-parallel ranks each rank binds its ", local, " own experts only (", local * 2 * I * C, " + ",
            local * C * I, ")");
    }
  }
  workspace_ = DeviceBuffer(workspace_bytes_);
  if (config_.num_layers_of(LayerType::full_attention) > 0)
    cudnn_attention_ = choose_cudnn_attention(cudnn_attention_config(config_, spec_.max_tokens, spec_.max_seqs),
                                              workspace_bytes_, "gpu text model attention");
  for (const DecoderLayerWeights& l : weights_.layers) {
    for (const DeviceParam* p : {&l.linear_attn.in_proj_qkv, &l.linear_attn.in_proj_z, &l.linear_attn.in_proj_b,
                                 &l.linear_attn.in_proj_a, &l.linear_attn.out_proj, &l.self_attn.q_proj,
                                 &l.self_attn.k_proj, &l.self_attn.v_proj, &l.self_attn.o_proj,
                                 &l.mlp.shared_gate_proj, &l.mlp.shared_up_proj, &l.mlp.shared_down_proj,
                                 &l.mlp.shared_expert_gate}) {
      lora_rank_ = std::max(lora_rank_, p->lora.rank);
    }
  }
  if (lora_rank_ > 0) {
    CHECK(lora_rank_ <= options_.lora_rank, "gpu model: adapters of rank ", lora_rank_, " on a model planned for rank ",
          options_.lora_rank, " (GpuModelOptions::lora_rank)");
    // The dense funnel's x A^T and dy B rows [T, r] (the first two parts); the shared expert's
    // adapters use the same buffer.
    lora_scratch_ = DeviceBuffer(shared_expert_lora_scratch_bytes(spec_.max_tokens, lora_rank_));
  }
  int64_t experts_rank = 0;
  for (const DecoderLayerWeights& l : weights_.layers) {
    experts_rank = std::max({experts_rank, l.mlp.experts_gate_up.lora.rank, l.mlp.experts_down.lora.rank});
  }
  if (experts_rank > 0) {
    CHECK(options_.expert_parallel == nullptr, "gpu model: LoRA adapters on the routed experts with expert ",
          "parallelism are not supported yet");
    const MoeExpertsDims dims{spec_.max_tokens, config_.hidden_size, config_.num_experts, config_.num_experts_per_tok,
                              config_.moe_intermediate_size};
    lora_experts_workspace_ = DeviceBuffer(moe_experts_lora_workspace_bytes(dims, experts_rank));
  }
  inputs_arena_ = std::make_unique<DeviceArena>(bytes_.inputs, "gpu text model inputs");
  ArenaCarver input_carver(inputs_arena_.get());
  carve_text_inputs(input_carver, config_, spec_, &inputs_);
  CUDA_CHECK(cudaMemsetAsync(inputs_.loss, 0, sizeof(float), stream_));
  CUDA_CHECK(cudaMemsetAsync(inputs_.aux_loss, 0, sizeof(double), stream_));
  plans_.resize(acts_.layers.size());
  expert_grads_hold_sum_.assign(acts_.layers.size(), 1);

  staging_ = std::make_unique<Staging>();
  staging_->bytes = bytes_.inputs + static_cast<size_t>(max_image_rows_ + 1) * sizeof(int32_t) + 512;
  staging_->block = pinned_malloc(staging_->bytes, "gpu text model: input staging");
  ArenaCarver staging_carver(staging_->block, staging_->bytes);
  carve_text_inputs(staging_carver, config_, spec_, &staging_->host);
  staging_->image_rows = staging_carver.take<int32_t>(max_image_rows_);
  CUDA_CHECK(cudaEventCreateWithFlags(&staging_->consumed, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(staging_->consumed, stream_));
  timer_.set_enabled(options_.time_components);
}

GpuTextModel::~GpuTextModel() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  gemm_.reset();
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
  int64_t supervised = 0;
  for (int64_t label : shifted_labels) {
    CHECK(label == -100 || (label >= 0 && label < config_.vocab_size), "gpu model: label ", label,
          " outside the vocabulary (and not -100)");
    if (label != -100) ++supervised;
  }
  // Validates cu_seqlens and positions and builds the rope tables exactly as the CPU model does.
  TextBatch batch = make_text_batch(config_, T, cu_seqlens, positions);
  const EmbeddingGradPlan embed_plan = embedding_grad_plan(ids.data(), T, config_.vocab_size);

  // The stream must have read the previous batch's staging before it is refilled (one event; the
  // host waits only when it runs more than a micro-batch ahead).
  CUDA_CHECK(cudaEventSynchronize(staging_->consumed));
  const TextInputs& host = staging_->host;
  uint64_t uploaded = 0;
  auto stage = [&](void* device, void* pinned, const void* values, size_t bytes) {
    if (bytes == 0) return;
    std::memcpy(pinned, values, bytes);
    CUDA_CHECK(cudaMemcpyAsync(device, pinned, bytes, cudaMemcpyHostToDevice, stream_));
    uploaded += bytes;
  };
  stage(inputs_.ids, host.ids, ids.data(), static_cast<size_t>(T) * 8);
  stage(inputs_.labels, host.labels, shifted_labels.data(), static_cast<size_t>(T) * 8);
  // The supervised rows, listed for the loss head (only they pass through lm_head), written
  // straight into the pinned staging.
  int64_t listed = 0;
  for (int64_t t = 0; t < T; ++t)
    if (shifted_labels[static_cast<size_t>(t)] != -100) host.supervised_rows[listed++] = static_cast<int32_t>(t);
  if (listed > 0) {
    CUDA_CHECK(cudaMemcpyAsync(inputs_.supervised_rows, host.supervised_rows, static_cast<size_t>(listed) * 4,
                               cudaMemcpyHostToDevice, stream_));
    uploaded += static_cast<uint64_t>(listed) * 4;
  }
  stage(inputs_.embed_sorted_tokens, host.embed_sorted_tokens, embed_plan.sorted_tokens.data(),
        embed_plan.sorted_tokens.size() * 4);
  stage(inputs_.embed_segment_offsets, host.embed_segment_offsets, embed_plan.segment_offsets.data(),
        embed_plan.segment_offsets.size() * 4);
  stage(inputs_.embed_segment_ids, host.embed_segment_ids, embed_plan.segment_ids.data(),
        embed_plan.segment_ids.size() * 8);
  stage(inputs_.cu_seqlens, host.cu_seqlens, cu_seqlens.data(), static_cast<size_t>(N + 1) * 4);
  stage(inputs_.positions, host.positions, batch.positions.data(), static_cast<size_t>(3 * T) * 8);
  // The same fp32 tables as the CPU reference (host-built), so the GPU rotation sees equal angles.
  stage(inputs_.rope_cos, host.rope_cos, batch.rope_cos.data(), batch.rope_cos.size() * 4);
  stage(inputs_.rope_sin, host.rope_sin, batch.rope_sin.data(), batch.rope_sin.size() * 4);
  CUDA_CHECK(cudaEventRecord(staging_->consumed, stream_));
  uploaded_bytes_ += uploaded;

  num_tokens_ = T;
  num_seqs_ = N;
  num_supervised_ = supervised;
  num_embed_segments_ = static_cast<int64_t>(embed_plan.segment_ids.size());
  host_cu_seqlens_ = cu_seqlens;
  rope_ = batch.rope;
  for (size_t i = 0; i < acts_.layers.size(); ++i)
    plans_[i] = moe_routing_plan_in(acts_.layers[i].moe.plan_memory, T, config_.num_experts,
                                    config_.num_experts_per_tok);
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
  CUDA_CHECK(cudaEventSynchronize(staging_->consumed));
  std::memcpy(staging_->image_rows, rows.data(), static_cast<size_t>(M) * sizeof(int32_t));
  CUDA_CHECK(cudaMemcpyAsync(acts_.image_rows, staging_->image_rows, static_cast<size_t>(M) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaEventRecord(staging_->consumed, stream_));
  uploaded_bytes_ += static_cast<uint64_t>(M) * sizeof(int32_t);
}

float GpuTextModel::read_loss() const {
  float loss = 0.0f;
  CUDA_CHECK(cudaMemcpyAsync(&loss, inputs_.loss, sizeof(float), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return loss;
}

double GpuTextModel::read_aux_loss() const {
  double aux = 0.0;
  CUDA_CHECK(cudaMemcpyAsync(&aux, inputs_.aux_loss, sizeof(double), cudaMemcpyDeviceToHost, stream_));
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

std::vector<int32_t> GpuTextModel::read_topk_idx(int64_t layer) const {
  CHECK(layer >= 0 && layer < config_.num_hidden_layers, "gpu model: no decoder layer ", layer);
  std::vector<int32_t> host(static_cast<size_t>(num_tokens_ * config_.num_experts_per_tok));
  CUDA_CHECK(cudaMemcpyAsync(host.data(), acts_.layers[static_cast<size_t>(layer)].moe.topk_idx, host.size() * 4,
                             cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return host;
}

std::vector<float> GpuTextModel::read_layer_activation(int64_t layer, LayerActivation which) const {
  CHECK(layer >= 0 && layer < config_.num_hidden_layers, "gpu model: no decoder layer ", layer);
  const LayerActivations& b = acts_.layers[static_cast<size_t>(layer)];
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
  if (acts_.captured_grads.empty()) return;
  float* slot = acts_.captured_grads[static_cast<size_t>(layer * 3 + static_cast<int64_t>(which))];
  CUDA_CHECK(cudaMemcpyAsync(slot, source, static_cast<size_t>(num_tokens_ * config_.hidden_size) * sizeof(float),
                             cudaMemcpyDeviceToDevice, stream_));
}

std::vector<float> GpuTextModel::read_layer_gradient(int64_t layer, LayerGradient which) const {
  CHECK(layer >= 0 && layer < config_.num_hidden_layers, "gpu model: no decoder layer ", layer);
  CHECK(!acts_.captured_grads.empty(), "gpu model: layer gradients were not captured (set options.capture_layer_grads)");
  const float* source = acts_.captured_grads[static_cast<size_t>(layer * 3 + static_cast<int64_t>(which))];
  return download(source, num_tokens_ * config_.hidden_size, stream_);
}

}  // namespace deltamoe
