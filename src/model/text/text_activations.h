// The activation layout of one training step of the text model on the GPU: what each decoder layer
// saves for its backward (GDN, attention or MoE parts), the temporaries one layer at a time, the
// shared streams, and the batch inputs. One function lays it out over an ArenaCarver, so it both
// sizes the arena (also in CPU builds, for the memory planner) and carves it (GpuTextModel).
// Legend: T tokens, C hidden, E experts, K top-k.
#pragma once

#include <cstdint>
#include <vector>

#include "core/device_bf16.h"
#include "model/arena_carver.h"
#include "model/config.h"

namespace deltamoe {

// Gated DeltaNet mixer: projections, conv outputs split into q/k/v, normalised q/k, gates, core.
struct GdnSaved {
  DeviceBf16 *mixed = nullptr, *z = nullptr;  // [T, conv], [T, vd]
  // Gate pre-activations in_proj_a(x), in_proj_b(x) [T, Hv], fp32 like their gradients: the gate
  // weights' gradients are sums over tokens that cancel, where bf16 rounding per token showed.
  float *a = nullptr, *b = nullptr;
  DeviceBf16 *q = nullptr, *k = nullptr, *v = nullptr;  // after conv + SiLU
  DeviceBf16 *q_normed = nullptr, *k_normed = nullptr;  // l2-normalised
  float *g = nullptr, *beta = nullptr;                  // [T, Hv]
  DeviceBf16 *core = nullptr, *normed = nullptr;        // [T, Hv, Dv]
  // With keep_gdn_forward: the gated delta rule forward's workspace (its chunk table, W, V_new,
  // P, A and chunk-entry states), kept for the backward instead of being recomputed there.
  void* rule_forward = nullptr;
  size_t rule_forward_bytes = 0;
};

// Gated attention mixer: q_proj output (query | gate per head), k/v, normed + rotated q/k, output.
struct AttentionSaved {
  DeviceBf16 *q_and_gate = nullptr, *k_raw = nullptr, *v = nullptr;
  DeviceBf16 *q = nullptr, *k = nullptr;
  float *q_rstd = nullptr, *k_rstd = nullptr;
  DeviceBf16* attn = nullptr;
  float* lse = nullptr;
  DeviceBf16* gated = nullptr;
};

// Sparse MoE block: router outputs, the routing plan's memory and, with keep_expert_rows, the
// routed experts' permuted inputs and gate/up rows (else the experts' backward forms them again).
struct MoeSaved {
  float *logits = nullptr, *probs = nullptr;
  int32_t* topk_idx = nullptr;
  float* topk_weight = nullptr;
  void* plan_memory = nullptr;  // moe_routing_plan_bytes(T, E, K)
  DeviceBf16* input_rows = nullptr;    // [T K, C], expert-major (null: not kept)
  DeviceBf16* gate_up_rows = nullptr;  // [T K, 2 I], expert-major (null: not kept)
};

struct LayerActivations {
  bool is_gdn = true;
  // The residual stream is fp32 (as under bf16 autocast with fp32 parameters); block outputs are
  // bf16 and are added to it inside the next norm.
  float* x_in = nullptr;            // residual stream entering the layer (layer 0: the embedding)
  DeviceBf16* normed_in = nullptr;  // input_layernorm output (mixer input)
  float* rstd_in = nullptr;
  DeviceBf16* mixer_out = nullptr;
  float* h = nullptr;                 // x_in + mixer_out
  DeviceBf16* normed_post = nullptr;  // post_attention_layernorm output (MoE input)
  float* rstd_post = nullptr;
  DeviceBf16* moe_out = nullptr;  // the layer's output is h + moe_out (added by the next norm)
  GdnSaved gdn;
  AttentionSaved attn;
  MoeSaved moe;
};

// Temporaries of one layer's forward or backward, reused by every layer.
struct LayerScratch {
  // GDN
  DeviceBf16 *d_normed_v = nullptr, *d_core = nullptr, *dz = nullptr;
  DeviceBf16 *dq_normed = nullptr, *dk_normed = nullptr, *dv = nullptr;
  float *dg = nullptr, *dbeta = nullptr;
  float *da = nullptr, *db = nullptr;  // [T, Hv] fp32 (see GdnSaved::a)
  DeviceBf16* d_conv = nullptr;   // [T, 2 kd]: the l2norm backward's dq then dk (the conv's q, k gradient)
  DeviceBf16* d_mixed = nullptr;  // [T, conv]: the conv's input gradient
  // attention
  DeviceBf16 *d_gated = nullptr, *d_q_and_gate = nullptr, *dq = nullptr, *dk = nullptr, *dv_attn = nullptr;
  DeviceBf16* dk_raw = nullptr;
  // MoE
  float *d_topk_weight = nullptr, *d_logits = nullptr;  // router gradients, fp32 throughout
  // The fp32 gate gradients' hi/lo bf16 halves as the column blocks of one GEMM operand
  // (kernels/gemm/f32_operand_cuda.h): the router's [dl_hi | dl_hi | dl_lo] [T, 3E], or GDN's
  // [da_hi | da_lo | db_hi | db_lo] [T, 4Hv] followed by dense hi and lo halves [T, Hv] of one of
  // them for a LoRA adapter's products.
  DeviceBf16* gate_grad_packed = nullptr;
  // The weights those blocks meet, stacked to match: the router's [w_hi; w_lo; w_hi] [3E, C] (the
  // hi/lo split of its fp32 weight, whose first 2E rows the forward reads as its pair) or GDN's
  // [Wa; Wa; Wb; Wb] [4Hv, C].
  DeviceBf16* gate_weight_stack = nullptr;
  // GDN's stacked weight-gradient product [4Hv, C] fp32: the hi and lo parts of in_proj_a's and
  // in_proj_b's gradients, added to them.
  float* gate_weight_grads = nullptr;
  // The low part of the MoE input [T, C] (its high part is normed_post), the router's other hi/lo
  // operand; remade in the forward and again in the backward, as every layer shares it.
  DeviceBf16* router_x_lo = nullptr;
  // A block's input gradient summed in fp32 [T, C]: the MoE block's (routed experts + router +
  // shared expert), read by post_attention_layernorm's backward, then the mixer's (summed over its
  // projections), read by input_layernorm's backward.
  float* d_mixer_input_f32 = nullptr;
};

// What the layout is planned for.
struct TextActivationSpec {
  int64_t max_tokens = 0;      // T: token budget of one micro-batch
  int64_t max_seqs = 1;        // packed sequences
  int64_t max_image_rows = 0;  // <|image_pad|> rows whose features come from the vision tower
  // Keep one set of mixer internals per layer type (recomputed before each mixer's backward).
  bool share_mixer_state = false;
  // Full recompute of the first `recompute_layers` decoder layers: each keeps only its fp32 input
  // (x_in); everything else they save is one set shared by them, refilled by rerunning the layer's
  // forward just before its backward.
  int64_t recompute_layers = 0;
  // Every layer not fully recomputed keeps its routed experts' permuted inputs and gate/up rows
  // from the forward, so that the experts' backward skips forming them again (a permute and a
  // grouped GEMM a layer) for T K x (C + 2 I) bf16 a layer. (A fully recomputed layer's rerun does
  // not run the experts: it forms them again.)
  bool keep_expert_rows = false;
  // Every GDN set (a layer's own, or the one that rerun mixers share) keeps the gated delta rule
  // forward's workspace for its backward (gated_delta_rule_backward_after_forward_cuda), which then
  // skips recomputing the chunk preparation and the state scan: the forward workspace layout for
  // max_tokens and max_seqs a set (320 MiB at 8,192 tokens and the 35B widths).
  bool keep_gdn_forward = false;
  bool capture_layer_grads = false;  // tests: 3 x [T, C] fp32 per layer
};

struct TextActivations {
  std::vector<LayerActivations> layers;
  LayerScratch scratch;
  float* embedded = nullptr;                  // [T, C] layer 0 input (the fp32 embedding rows)
  float* final_hidden = nullptr;              // [T, C] residual stream after the last layer
  DeviceBf16* final_normed = nullptr;         // [T, C]
  float* final_rstd = nullptr;                // [T]
  float* grad_stream = nullptr;               // [T, C] gradient reaching a layer's output, then its input
  DeviceBf16* grad_stream_bf16 = nullptr;     // [T, C] its bf16 copy (the MoE backward's dy)
  float* grad_mixer = nullptr;                // [T, C] gradient reaching the mixer output (dh)
  DeviceBf16* grad_mixer_bf16 = nullptr;      // [T, C] its bf16 copy (the mixer backward's dy)
  DeviceBf16* grad_normed = nullptr;          // [T, C] the final norm's output gradient; MoE scratch
  int32_t* image_rows = nullptr;              // [max_image_rows]
  DeviceBf16* image_embeds = nullptr;         // [max_image_rows, C]
  DeviceBf16* image_grads = nullptr;          // [max_image_rows, C]
  std::vector<float*> captured_grads;         // [layer * 3 + which] -> [T, C] (capture_layer_grads)
};

// Lays out every activation of the step; with a counting carver (null arena) it only sizes them.
void carve_text_activations(ArenaCarver& carver, const TextConfig& config, const TextActivationSpec& spec,
                            TextActivations* out);
// Bytes of that layout.
size_t text_activation_bytes(const TextConfig& config, const TextActivationSpec& spec);

// The batch inputs on the device: ids, labels, the tokens grouped by id for the embedding backward,
// cu_seqlens, positions, rope tables, the loss scalars and the aux-loss statistics.
struct TextInputs {
  int64_t* ids = nullptr;                  // [T]
  int64_t* labels = nullptr;               // [T] shifted, -100 ignored
  int32_t* supervised_rows = nullptr;      // [T] the rows whose label is not ignored, in order (first S used)
  int32_t* embed_sorted_tokens = nullptr;  // [T]   (embedding_grad_plan.h)
  int32_t* embed_segment_offsets = nullptr;  // [T + 1]
  int64_t* embed_segment_ids = nullptr;    // [T]
  int32_t* cu_seqlens = nullptr;           // [seqs + 1]
  int64_t* positions = nullptr;            // [3, T]
  float* rope_cos = nullptr;               // [T, rotary / 2]
  float* rope_sin = nullptr;
  float* token_loss = nullptr;             // [T] (the supervised rows' first, in order)
  float* lse = nullptr;                    // [T] (likewise)
  float* loss = nullptr;                   // mean CE of the last forward
  double* aux_loss = nullptr;
  double* aux_counts = nullptr;            // [E] selection counts over all layers
  double* aux_probs = nullptr;             // [E] probability sums over all layers
};
void carve_text_inputs(ArenaCarver& carver, const TextConfig& config, const TextActivationSpec& spec, TextInputs* out);
size_t text_input_bytes(const TextConfig& config, const TextActivationSpec& spec);

}  // namespace deltamoe
