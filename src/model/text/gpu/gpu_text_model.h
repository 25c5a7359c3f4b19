// GpuTextModel: the Qwen3.5-MoE text model trained on one GPU, composed from the CUDA kernels. It
// reads its parameters through typed views bound once (TextWeights; the owner is DeviceParams) and
// plans its activations and workspaces once from (config, token budget) into one DeviceArena, so a
// step neither allocates nor synchronises with the host. Gradients are ADDED to the views' grad
// buffers (the owner zeroes them once per optimizer step): micro-batches accumulate on the device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/device_buffer.h"
#include "kernels/gated_delta_rule/gated_delta_rule.h"
#include "kernels/moe_experts/moe_experts_cuda.h"
#include "kernels/mrope/mrope.h"
#include "kernels/shared_expert/shared_expert_cuda.h"
#include "model/config.h"
#include "model/gradient_phases.h"
#include "model/gpu/component_timer.h"
#include "model/text/text_weights.h"
#include "model/text/text_activations.h"

namespace deltamoe {

class Communicator;
class GemmContext;
class CudnnSdpa;
class GpuExpertParallel;

// Saved activations a test can download to localise a mismatch (per decoder layer).
enum class LayerActivation {
  input,        // [T, C] residual stream entering the layer (fp32)
  mixer_input,  // [T, C] input_layernorm output
  after_mixer,  // [T, C] input + mixer output (h, fp32)
  moe_input,    // [T, C] post_attention_layernorm output
  router_probs, // [T, E] router softmax (fp32)
};

// Residual-stream gradients of one decoder layer, kept when GpuModelOptions::capture_layer_grads
// is set, so a test can tell which layer's backward goes wrong (not only which weight).
enum class LayerGradient {
  output,       // [T, C] gradient reaching the layer's output (h + moe_out)
  after_mixer,  // [T, C] gradient reaching h (MoE branch + skip), i.e. the mixer output's gradient
  input,        // [T, C] gradient the layer passes to its input (the previous layer's output)
};

struct GpuModelOptions {
  int64_t max_tokens = 8192;         // token budget of one micro-batch (activations are planned for it)
  int64_t max_seqs = 64;             // most packed sequences in one micro-batch
  int64_t loss_chunk_rows = 2048;    // lm_head + cross-entropy chunk (logits never held for all tokens)
  float ce_loss_weight = 1.0f;       // the backward differentiates ce_weight * ce + aux_weight * aux
  float aux_loss_weight = 0.0f;      // router load-balancing loss weight (0: HF default, no aux loss)
  bool time_components = false;      // record CUDA events between components (bench)
  // Keep only one set of mixer internals per layer type and rerun each mixer's forward just before
  // its backward: saves the GDN/attention intermediates of all but one layer for ~1/3 more mixer time.
  bool recompute_mixers = false;
  // Full recompute (Megatron's --recompute_granularity full, method block): the first
  // `recompute_layers` decoder layers keep only their fp32 input and rerun their whole forward just
  // before their backward; their other saved state is one shared set. read_layer_activation and
  // read_topk_idx then show the last rerun's values for those layers.
  int64_t recompute_layers = 0;
  // Keep the routed experts' permuted inputs and gate/up rows of the layers not fully recomputed
  // from the forward, so that their backward skips forming them again
  // (TextActivationSpec::keep_expert_rows); not with
  // expert parallelism (the exchanged rows are recomputed there).
  bool keep_expert_rows = false;
  // Keep each GDN set's gated delta rule forward workspace for its backward, which then skips
  // recomputing the forward's chunk quantities (TextActivationSpec::keep_gdn_forward).
  bool keep_gdn_forward = false;
  // Tests: keep copies of every layer's residual-stream gradients (3 x [T, C] fp32 per layer).
  bool capture_layer_grads = false;
  // Most image-token rows of one micro-batch (the VLM input: vision features scattered over them);
  // -1: max_tokens; 0: text only (no image slots are allocated).
  int64_t max_image_rows = -1;
  // Expert parallelism: the group the routed experts are split over (not owned; null: every expert
  // on this rank). The bound expert tensors hold this rank's block only ([E / EP, ...], its local
  // expert 0 first; checked at construction): the rank computes and forms gradients for them
  // (gpu_expert_parallel.h).
  Communicator* expert_parallel = nullptr;
  // Rows this rank's experts may receive per micro-batch (0: the worst case, EP x max_tokens x K).
  int64_t expert_recv_rows = 0;
  // LoRA rank of the bound adapters (0: none), so that planned_bytes counts their scratch; the
  // model allocates what the bound weights need.
  int64_t lora_rank = 0;
  // LoRA dropout: the widest input of a dense adapter that drops (0: no dropout). planned_bytes
  // counts, and the model allocates, its scratch (lora_dropout_scratch_bytes(max_tokens, it)).
  int64_t lora_dropout_max_in = 0;
};

// Device bytes the model itself holds (its parameters belong to DeviceParams).
struct GpuModelBytes {
  size_t activations = 0;  // the planned activation arena
  size_t workspace = 0;    // kernel workspaces (one at a time on the stream) and cuBLASLt's
  size_t inputs = 0;       // batch inputs, rope tables, loss scalars
  size_t total() const { return activations + workspace + inputs; }
};

class GpuTextModel {
 public:
  // weights must stay valid for the model's life. All work goes to `stream` (not owned).
  GpuTextModel(const TextConfig& config, const TextWeights& weights, const GpuModelOptions& options,
               cudaStream_t stream);
  ~GpuTextModel();
  GpuTextModel(const GpuTextModel&) = delete;
  GpuTextModel& operator=(const GpuTextModel&) = delete;

  // The bytes a model of these options allocates, computed without allocating (memory planning).
  static GpuModelBytes planned_bytes(const TextConfig& config, const GpuModelOptions& options);

  const TextConfig& config() const { return config_; }
  cudaStream_t stream() const { return stream_; }

  // Copies one micro-batch's inputs to the device, ahead of its forward on the stream: ids and
  // shifted labels [T] (label -100 ignored), cu_seqlens [N+1] and positions [3, T] (empty: text
  // positions). Validates on the host; the host vectors may go when it returns (the copies are
  // staged in pinned memory, which the next call reuses after the stream has read it).
  void set_batch(const std::vector<int64_t>& ids, const std::vector<int64_t>& shifted_labels,
                 const std::vector<int32_t>& cu_seqlens, const std::vector<int64_t>& positions = {});

  // The multimodal input (like set_batch, either order): rows int32 [M] are the token rows of
  // <|image_pad|> in the batch, strictly increasing; [] = text only. Before each forward the caller
  // writes the vision tower's output into image_embeddings(); the embedding step places it over
  // those rows, and the backward gathers their gradient into image_embedding_grads() instead of
  // adding it to embed_tokens' gradient.
  void set_image_rows(const std::vector<int32_t>& rows);
  int64_t num_image_rows() const { return num_image_rows_; }
  // [M, C] bf16 device slot; write before the forward (on stream()).
  __nv_bfloat16* image_embeddings() { return acts_.image_embeds; }
  // [M, C] bf16 device: d loss / d image_embeddings, valid after backward() (on stream()).
  const __nv_bfloat16* image_embedding_grads() const { return acts_.image_grads; }

  // Forward of the batch (the loss is formed in backward, with the lm_head). No host sync.
  void forward();
  // Backward: the trained parameters' gradients are added to; frozen ones form none. The fused
  // lm_head + cross-entropy runs here and writes the loss. No host sync.
  void backward();
  // Forward and the loss only (evaluation): no gradient is formed. No host sync.
  void forward_loss();
  // Called by backward() as each gradient phase is finished (the loss head, each layer from the
  // last, the token embedding), with that phase's work queued on stream(); none by default.
  void set_gradient_ready_hook(GradientReadyHook hook) { gradient_ready_ = std::move(hook); }
  void forward_backward() {
    forward();
    backward();
  }
  // The routed experts' gradients of a step, and lm_head's where set_lm_head_gradient_written_first
  // asked: the caller left them unzeroed (DeviceParams::zero_gradients with leave_written_first),
  // so each layer's first backward of the step writes them (WeightGradOutput::written: no zeroing
  // pass, no read of the old values), as the first loss chunk of the step's first backward writes
  // lm_head's, and later ones add to them. zero_unwritten_gradients() then zeroes those no
  // backward reached. Outside such a window every backward adds, as documented above.
  // With squares (a step of one backward, whose written expert gradients are final): each layer's
  // written gate_up and down gradients also set their sums of squares (moe_experts_cuda.h) in
  // squares->sums[2 layer], [2 layer + 1]; every other entry is 0. A second backward in the window
  // is refused then, since it would change gradients whose sums are already formed.
  struct ExpertSquaresSink {
    double* sums = nullptr;  // device, [num_hidden_layers][2]: gate_up, down
    double divisor = 1.0;    // the step's gradient divisor
    void* scratch = nullptr;  // kWeightGradSquaresScratchBytes
  };
  void begin_gradient_step(const ExpertSquaresSink* squares = nullptr);
  void zero_unwritten_gradients();
  // lm_head's gradient (fp32, [V, H]: 2 GB at Qwen3.5's widths) joins the window above: its zeroing
  // pass and the first loss chunk's read of it are skipped. Its sum of squares is still read by
  // the norm (the loss head forms none). Off by default.
  void set_lm_head_gradient_written_first(bool on);

  // Changes the loss weights of later backwards (e.g. parity: one backward per loss).
  void set_loss_weights(float ce_weight, float aux_weight) {
    options_.ce_loss_weight = ce_weight;
    options_.aux_loss_weight = aux_weight;
  }
  // LoRA dropout (PEFT's B(A(dropout(x))), kernels/lora/lora_dropout_mask.h): the counters of the
  // next forward and backward (one micro-batch: a recomputed layer sees the mask of its first
  // forward). A key with p 0 (the default) drops nothing; p > 0 needs options.lora_dropout_max_in.
  void set_lora_dropout(const LoraDropoutKey& key);
  // Device scalars of the last forward: mean CE over the supervised tokens (f32), aux loss (f64).
  const float* device_loss() const { return inputs_.loss; }
  const double* device_aux_loss() const { return inputs_.aux_loss; }
  // Logits [T, V] fp32 of the last forward. Allocates a [T, V] buffer: for parity checks and
  // evaluation of small batches only, never inside a training step. Synchronises.
  std::vector<float> compute_logits() const;

  // Reads the mean cross-entropy and the aux-loss value of the last forward (synchronises).
  float read_loss() const;
  double read_aux_loss() const;
  // Downloads the experts chosen for every token of decoder layer `layer` ([T, K], synchronises).
  std::vector<int32_t> read_topk_idx(int64_t layer) const;
  // Downloads one saved activation of decoder layer `layer` as fp32 (synchronises).
  std::vector<float> read_layer_activation(int64_t layer, LayerActivation which) const;
  // Downloads one captured residual-stream gradient of decoder layer `layer` as fp32 (needs
  // options.capture_layer_grads; synchronises).
  std::vector<float> read_layer_gradient(int64_t layer, LayerGradient which) const;

  GpuModelBytes bytes() const { return bytes_; }
  ComponentTimer& timer() { return timer_; }
  int64_t num_tokens() const { return num_tokens_; }
  // The full-attention layers' backend chosen at setup: "cudnn" (fused SDPA) or "ours" (flash attention).
  const char* attention_backend() const { return cudnn_attention_ != nullptr ? "cudnn" : "ours"; }
  const std::vector<int32_t>& host_cu_seqlens() const { return host_cu_seqlens_; }
  // Host-to-device bytes of the batches set so far (for the step's transfer counter).
  uint64_t uploaded_bytes() const { return uploaded_bytes_; }

 private:
  void embed();
  void gdn_forward(int64_t layer);
  // Mixer backwards: dy [T, C] bf16 (the bf16 copy of the stream gradient); dx [T, C] f32 written
  // with the input gradient summed over the mixer's projections in fp32.
  void gdn_backward(int64_t layer, const __nv_bfloat16* dy, float* dx);
  // The gated delta rule's shape for this micro-batch (its packing, the config's heads and widths).
  GatedDeltaRuleShape gdn_rule_shape() const;
  void attention_forward(int64_t layer);
  void attention_backward(int64_t layer, const __nv_bfloat16* dy, float* dx);
  // One decoder layer's forward. recompute: the rerun before its backward (full recompute) from the
  // kept input, refilling the saved state without counting the layer in the aux statistics again.
  void layer_forward(int64_t layer, bool recompute);
  // recompute: the router (and, on one rank, the routing plan) only.
  void moe_forward(int64_t layer, bool recompute);
  // dx [T, C] f32 written: the routed experts', router's and shared expert's input gradients summed.
  void moe_backward(int64_t layer, const __nv_bfloat16* dy, float* dx);
  // The router's hi/lo operands into scratch: the MoE input's low part (from the fp32 stream h,
  // rstd_post and normed_post) and the fp32 router weight's halves. Called by the forward and again
  // by the backward (other layers reuse the scratch in between).
  void split_router_operands(int64_t layer);
  // The projection funnel (compare llama.cpp's build_lora_mm): y [rows, out] = x W^T written as
  // y_dtype, plus the LoRA term when w carries an adapter (kernels/lora/lora_cuda.h).
  void project(const DeviceParam& w, const __nv_bfloat16* x, void* y, DType y_dtype, int64_t rows,
               int64_t in_features, int64_t out_features);
  // The adapter's share of a projection's backward, beside the base dX product (nothing without an
  // adapter): dx [rows, in] (bf16 or f32) added to, dA and dB added to when the adapter is trained.
  void lora_backward(const DeviceParam& w, const __nv_bfloat16* x, const __nv_bfloat16* dy, void* dx, DType dx_dtype,
                     int64_t rows, int64_t in_features, int64_t out_features);
  // Copies a [T, C] gradient into its capture slot when capture_layer_grads is on (else nothing).
  void capture_gradient(int64_t layer, LayerGradient which, const float* source);
  // A projection's weight gradient dW [N, K] += dy^T x, skipped for a frozen weight.
  void weight_grad(const DeviceParam& w, const __nv_bfloat16* dy, const __nv_bfloat16* x, int64_t rows,
                   int64_t in_features, int64_t out_features);
  // Backward of GDN's gate projections in_proj_a and in_proj_b, whose output gradients da, db [T, Hv]
  // are fp32: dx [T, C] (fp32) += da Wa + db Wb and their weight gradients += da^T x, db^T x (when
  // trained), from the hi/lo bf16 halves of da and db stacked into one product each
  // (kernels/gemm/f32_operand_cuda.h), so neither is rounded to bf16.
  void gdn_gate_projections_backward(const GdnWeights& W, const __nv_bfloat16* x, float* dx);

  TextConfig config_;
  TextWeights weights_;
  GpuModelOptions options_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<GemmContext> gemm_;
  ComponentTimer timer_;
  GradientReadyHook gradient_ready_;
  GpuModelBytes bytes_;

  TextActivationSpec spec_;
  std::unique_ptr<DeviceArena> arena_;   // activations, planned once
  TextActivations acts_;
  DeviceBuffer workspace_;               // shared by every kernel, used one at a time on stream_
  size_t workspace_bytes_ = 0;
  std::unique_ptr<DeviceArena> inputs_arena_;
  TextInputs inputs_;
  std::vector<MoeRoutingPlan> plans_;    // per layer, laid out in its plan_memory for the batch
  // Per layer: whether its routed-expert gradients hold this step's sum so far (true outside a
  // begin_gradient_step window: backwards add); the same for lm_head's gradient.
  std::vector<uint8_t> expert_grads_hold_sum_;
  bool lm_head_written_first_ = false;
  bool lm_head_grad_holds_sum_ = true;
  std::optional<ExpertSquaresSink> expert_squares_;  // set inside a window that asked for them
  std::unique_ptr<GpuExpertParallel> expert_parallel_;  // null: all experts on this rank
  // With expert parallelism: the shared expert's fp32 output and gate logit, computed while the
  // host waits for the exchanged counts and added to the routed output after the combine
  // (SharedExpertPending, shared_expert_pending_bytes); empty without.
  DeviceBuffer shared_expert_pending_;
  // The full-attention layers' backend, chosen at setup (cudnn_attention_choice.h): cuDNN's fused
  // SDPA plans, or null for our flash-attention kernel. Both save lse [T, Hq] fp32.
  std::unique_ptr<CudnnSdpa> cudnn_attention_;

  // Pinned staging of the batch inputs (one micro-batch ahead at most): the stream reads it, the
  // next set_batch waits for that read (an event) before refilling it.
  struct Staging;
  std::unique_ptr<Staging> staging_;
  uint64_t uploaded_bytes_ = 0;

  // LoRA scratch: x A^T and s dy B [max_tokens, largest rank] bf16 (recomputed per projection, so
  // nothing is saved per layer), shared with the shared expert's adapters
  // (shared_expert_lora_scratch_bytes); empty without adapters.
  DeviceBuffer lora_scratch_;
  int64_t lora_rank_ = 0;
  // Routed-expert adapters' workspace (moe_experts_lora_workspace_bytes); empty without them.
  DeviceBuffer lora_experts_workspace_;
  // The routed experts' adapters of a layer (null when it has none).
  const MoeExpertsLora* experts_lora(int64_t layer, MoeExpertsLora* out) const;
  // The shared expert's adapters of a layer in *out, or null when it has none.
  const SharedExpertLora* shared_expert_lora(int64_t layer, SharedExpertLora* out) const;
  // LoRA dropout: the scratch (options.lora_dropout_max_in; empty without dropout) and this pass's key.
  DeviceBuffer lora_dropout_scratch_;
  LoraDropoutKey lora_dropout_;
  // The dropout of adapter views in this pass (an inactive mask: none).
  LoraDropoutPass lora_dropout_pass(const DeviceLoraViews& views) const;

  int64_t num_tokens_ = 0;
  int64_t num_seqs_ = 0;
  int64_t num_supervised_ = 0;
  int64_t num_embed_segments_ = 0;
  std::vector<int32_t> host_cu_seqlens_;
  int64_t max_image_rows_ = 0;
  int64_t num_image_rows_ = 0;
  int64_t last_image_row_ = -1;  // host copy of the largest row, checked against the batch
  MropeSpec rope_;
};

}  // namespace deltamoe
