// GpuTextModel: the Qwen3.5-MoE text model trained on one GPU, composed from the CUDA kernels.
// Parameters live in flat buffers laid out by ParamLayout (fp32 master, fp32 gradients, AdamW
// moments, bf16 working copy); activations and workspaces are planned once from (config, token
// budget) into one DeviceArena, so a step neither allocates nor synchronises with the host.
#pragma once

#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/device_buffer.h"
#include "core/dtype.h"
#include "kernels/mrope/mrope.h"
#include "model/config.h"
#include "model/text/text_params.h"
#include "optim/adamw.h"
#include "optim/param_layout.h"
#include "train/gpu/component_timer.h"

namespace deltamoe {

class GemmContext;
struct GpuLayerBuffers;
struct GpuScratch;

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
  int64_t max_tokens = 8192;         // token budget of one step (activations are planned for it)
  int64_t max_seqs = 64;             // most packed sequences in one step
  int64_t loss_chunk_rows = 1024;    // lm_head + cross-entropy chunk (logits never held for all tokens)
  AdamWConfig adamw;                 // moment_dtype f32 or bf16
  float ce_loss_weight = 1.0f;       // the backward differentiates ce_weight * ce + aux_weight * aux
  float aux_loss_weight = 0.0f;      // router load-balancing loss weight (0: HF default, no aux loss)
  bool time_components = false;      // record CUDA events between components (bench)
  // Keep only one set of mixer internals per layer type and rerun each mixer's forward just before
  // its backward: saves the GDN/attention intermediates of all but one layer for ~1/3 more mixer time.
  bool recompute_mixers = false;
  // Tests: keep copies of every layer's residual-stream gradients (3 x [T, C] fp32 per layer).
  bool capture_layer_grads = false;
  // Most image-token rows of one step (the VLM input: vision features scattered over them);
  // -1: max_tokens; 0: text only (no image slots are allocated).
  int64_t max_image_rows = -1;
};

// Bytes held on the device, by kind.
struct GpuMemoryBreakdown {
  size_t weights = 0;      // bf16 working copy + fp32 master
  size_t gradients = 0;    // fp32 flat gradients
  size_t optimizer = 0;    // AdamW moments
  size_t activations = 0;  // planned activation arena
  size_t workspace = 0;    // kernel workspaces, cuBLASLt workspace, batch inputs
};

class GpuTextModel {
 public:
  GpuTextModel(const TextConfig& config, std::string prefix, const GpuModelOptions& options);
  ~GpuTextModel();
  GpuTextModel(const GpuTextModel&) = delete;
  GpuTextModel& operator=(const GpuTextModel&) = delete;

  const ParamLayout& layout() const { return layout_; }
  const TextConfig& config() const { return config_; }
  cudaStream_t stream() const { return stream_; }

  // fp32 host parameters (every name of text_param_shapes) -> master and bf16 copy. Synchronises.
  void upload_params(const ParamMap& params);
  // Random parameters on the device (bench): matrices normal(0, matrix_std), zero-centred norms 0,
  // the GDN norm weight 1, A_log log(1..16)-like values, dt_bias 1. Does not synchronise.
  void randomize_params(uint64_t seed, float matrix_std);

  // Copies one batch's inputs to the device (outside the step): ids and shifted labels [T] (label
  // -100 ignored), cu_seqlens [N+1] and positions [3, T] (empty: text positions). Validates on the host.
  void set_batch(const std::vector<int64_t>& ids, const std::vector<int64_t>& shifted_labels,
                 const std::vector<int32_t>& cu_seqlens, const std::vector<int64_t>& positions = {});

  // The multimodal input (outside the step, like set_batch; either order): rows int32 [M] are the
  // token rows of <|image_pad|> in the batch, strictly increasing; [] = text only. Before each
  // forward_backward() the caller writes the vision tower's output into image_embeddings(); the
  // embedding step places it over those rows, and the backward gathers their gradient into
  // image_embedding_grads() instead of adding it to embed_tokens' gradient. Synchronises.
  void set_image_rows(const std::vector<int32_t>& rows);
  int64_t num_image_rows() const { return num_image_rows_; }
  // [M, C] bf16 device slot; write before forward_backward() (on stream() or synchronised with it).
  __nv_bfloat16* image_embeddings() { return image_embeds_; }
  // [M, C] bf16 device: d loss / d image_embeddings, valid after forward_backward() (on stream()).
  const __nv_bfloat16* image_embedding_grads() const { return image_grads_; }

  // Forward and backward of the batch: gradients are zeroed then written. No host sync.
  void forward_backward();
  // One AdamW update of every parameter (adam_step counted from 1). No host sync.
  void optimizer_step(double lr, int64_t adam_step);

  // Changes the loss weights of later backwards (e.g. parity: one backward per loss).
  void set_loss_weights(float ce_weight, float aux_weight) {
    options_.ce_loss_weight = ce_weight;
    options_.aux_loss_weight = aux_weight;
  }
  // Logits [T, V] fp32 of the last forward (final_normed x lm_head^T). Allocates a [T, V] buffer:
  // for parity checks on small batches only, never inside a training step. Synchronises.
  std::vector<float> compute_logits() const;

  // Reads the mean cross-entropy and the aux-loss value of the last forward (synchronises).
  float read_loss() const;
  double read_aux_loss() const;
  // Downloads the fp32 gradient of one parameter (synchronises).
  std::vector<float> read_gradient(const std::string& name) const;
  std::vector<float> read_master(const std::string& name) const;
  // Downloads the experts chosen for every token of decoder layer `layer` ([T, K], synchronises),
  // e.g. to pin the CPU reference's routing to the GPU's in a comparison.
  std::vector<int32_t> read_topk_idx(int64_t layer) const;
  // Downloads one saved activation of decoder layer `layer` as fp32 (synchronises).
  std::vector<float> read_layer_activation(int64_t layer, LayerActivation which) const;
  // Downloads one captured residual-stream gradient of decoder layer `layer` as fp32 (needs
  // options.capture_layer_grads; synchronises).
  std::vector<float> read_layer_gradient(int64_t layer, LayerGradient which) const;

  GpuMemoryBreakdown memory() const;
  ComponentTimer& timer() { return timer_; }
  int64_t num_tokens() const { return num_tokens_; }
  const std::vector<int32_t>& host_cu_seqlens() const { return host_cu_seqlens_; }

 private:
  void plan_activations();
  void forward();
  void backward();
  void gdn_forward(int64_t layer);
  // Mixer backwards: dy [T, C] bf16 (the bf16 copy of the stream gradient); dx [T, C] f32 written
  // with the input gradient summed over the mixer's projections in fp32.
  void gdn_backward(int64_t layer, const __nv_bfloat16* dy, float* dx);
  void attention_forward(int64_t layer);
  void attention_backward(int64_t layer, const __nv_bfloat16* dy, float* dx);
  void moe_forward(int64_t layer);
  // dx [T, C] f32 written: the routed experts', router's and shared expert's input gradients summed.
  void moe_backward(int64_t layer, const __nv_bfloat16* dy, float* dx);
  // The router's hi/lo operands into scratch: the MoE input's low part (from the fp32 stream h,
  // rstd_post and normed_post) and the fp32 master router weight's halves. Called by the forward
  // and again by the backward (other layers reuse the scratch in between).
  void split_router_operands(int64_t layer);
  // Copies a [T, C] gradient into its capture slot when capture_layer_grads is on (else nothing).
  void capture_gradient(int64_t layer, LayerGradient which, const float* source);
  // Pointers into the flat buffers of parameter `name` (of layer `layer` when layer >= 0).
  const __nv_bfloat16* weight(int64_t layer, const std::string& name) const;
  float* master(int64_t layer, const std::string& name) const;
  float* grad(int64_t layer, const std::string& name) const;
  int64_t offset_of(int64_t layer, const std::string& name) const;
  // Backward of a projection whose output gradient dy [T, N] is fp32 (the per-token gates: GDN a/b,
  // the router logits): dW [N, K] += dy^T x and dx [T, K] (fp32) (+)= dy W, each as two bf16 GEMMs
  // on dy's hi/lo bf16 halves (scratch gate_grad_hi/lo), so dy is not rounded to bf16.
  void linear_backward_f32_dy(const float* dy, const __nv_bfloat16* w, const __nv_bfloat16* x, float* dw, float* dx,
                              bool add, int64_t rows, int64_t in_features, int64_t out_features);

  TextConfig config_;
  std::string prefix_;
  GpuModelOptions options_;
  ParamLayout layout_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  std::unique_ptr<GemmContext> gemm_;
  ComponentTimer timer_;

  DeviceBuffer master_, grads_, moment_m_, moment_v_, weights_bf16_;
  std::unique_ptr<DeviceArena> arena_;  // activations, planned once
  size_t activation_bytes_ = 0;
  DeviceBuffer workspace_;              // shared by every kernel, used one at a time on stream_
  size_t workspace_bytes_ = 0;
  DeviceBuffer inputs_;                 // ids, labels, cu_seqlens, positions, rope tables, losses
  size_t inputs_bytes_ = 0;

  // Batch inputs on the device (inside inputs_).
  int64_t* ids_ = nullptr;
  int64_t* labels_ = nullptr;
  int32_t* cu_seqlens_ = nullptr;
  int64_t* positions_ = nullptr;
  float* rope_cos_ = nullptr;
  float* rope_sin_ = nullptr;
  float* token_loss_ = nullptr;
  float* lse_ = nullptr;
  float* loss_ = nullptr;
  double* aux_loss_ = nullptr;
  double* aux_counts_ = nullptr;  // [E] fp64 selection counts over all layers
  double* aux_probs_ = nullptr;   // [E] fp64 probability sums over all layers
  int64_t num_tokens_ = 0;
  int64_t num_seqs_ = 0;
  int64_t num_supervised_ = 0;
  std::vector<int32_t> host_cu_seqlens_;
  // Multimodal input (inside arena_): rows of the image tokens and their embeddings / gradients.
  int64_t max_image_rows_ = 0;
  int64_t num_image_rows_ = 0;
  int64_t last_image_row_ = -1;             // host copy of the largest row, checked against the batch
  int32_t* image_rows_ = nullptr;           // [max_image_rows] int32
  __nv_bfloat16* image_embeds_ = nullptr;   // [max_image_rows, C]
  __nv_bfloat16* image_grads_ = nullptr;    // [max_image_rows, C]

  // Activations (inside arena_): per layer, plus the shared ones below. The residual stream and its
  // gradient are fp32; each stream gradient has a bf16 copy for the GEMMs of the block before it.
  std::vector<GpuLayerBuffers> layers_;
  float* embedded_ = nullptr;                  // [T, C] layer 0 input (the fp32 embedding rows)
  float* final_hidden_ = nullptr;              // [T, C] residual stream after the last layer
  __nv_bfloat16* final_normed_ = nullptr;      // [T, C]
  float* final_rstd_ = nullptr;                // [T]
  float* grad_stream_ = nullptr;               // [T, C] gradient reaching a layer's output, then its input
  __nv_bfloat16* grad_stream_bf16_ = nullptr;  // [T, C] its bf16 copy (the MoE backward's dy)
  float* grad_mixer_ = nullptr;                // [T, C] gradient reaching the mixer output (dh)
  __nv_bfloat16* grad_mixer_bf16_ = nullptr;   // [T, C] its bf16 copy (the mixer backward's dy)
  __nv_bfloat16* grad_normed_ = nullptr;       // [T, C] the final norm's output gradient; MoE scratch
  // [layer * 3 + LayerGradient] -> [T, C] fp32 copies (empty unless capture_layer_grads).
  std::vector<float*> captured_grads_;
  // Backward scratch sized for the widest layer (reused by every layer, one at a time).
  std::unique_ptr<GpuScratch> scratch_;
  MropeSpec rope_;
};

}  // namespace deltamoe
