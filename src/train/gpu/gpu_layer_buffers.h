// Device pointers of the activations a GpuTextModel plans once: what each decoder layer saves for
// its backward (GDN, attention or MoE parts) and the per-layer temporaries shared by all layers.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/moe_experts/moe_experts_cuda.h"

namespace deltamoe {

using DeviceBf16 = __nv_bfloat16;

// Gated DeltaNet mixer: projections, conv outputs split into q/k/v, normalised q/k, gates, core.
struct GdnSaved {
  DeviceBf16 *mixed = nullptr, *z = nullptr;  // [T, conv], [T, vd]
  // Gate pre-activations in_proj_a(x), in_proj_b(x) [T, Hv], fp32 like their gradients: the gate
  // weights' gradients are sums over tokens that cancel, where bf16 rounding per token showed.
  float *a = nullptr, *b = nullptr;
  DeviceBf16 *q = nullptr, *k = nullptr, *v = nullptr;                    // after conv + SiLU
  DeviceBf16 *q_normed = nullptr, *k_normed = nullptr;                    // l2-normalised
  float *g = nullptr, *beta = nullptr;                                    // [T, Hv]
  DeviceBf16 *core = nullptr, *normed = nullptr;                          // [T, Hv, Dv]
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

// Sparse MoE block: router outputs and the routing plan (the experts recompute their activations).
struct MoeSaved {
  float *logits = nullptr, *probs = nullptr;
  int32_t* topk_idx = nullptr;
  float* topk_weight = nullptr;
  void* plan_memory = nullptr;
  MoeRoutingPlan plan;  // laid out in plan_memory for the batch's token count
};

struct GpuLayerBuffers {
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
struct GpuScratch {
  // GDN
  DeviceBf16 *conv = nullptr, *d_normed_v = nullptr, *d_core = nullptr, *dz = nullptr;
  DeviceBf16 *dq_normed = nullptr, *dk_normed = nullptr, *dv = nullptr;
  float *dg = nullptr, *dbeta = nullptr;
  float *da = nullptr, *db = nullptr;  // [T, Hv] fp32 (see GdnSaved::a)
  DeviceBf16 *d_conv = nullptr, *d_mixed = nullptr;
  // attention
  DeviceBf16 *d_gated = nullptr, *d_q_and_gate = nullptr, *dq = nullptr, *dk = nullptr, *dv_attn = nullptr;
  DeviceBf16* dk_raw = nullptr;
  // MoE
  float *d_topk_weight = nullptr, *d_logits = nullptr;  // router gradients, fp32 throughout
  // hi/lo bf16 halves of one fp32 gate gradient (da, db or d_logits) [T, max(Hv, E)] for the two-GEMM
  // products with the bf16 weights and inputs (kernels/gemm/f32_operand_cuda.h).
  DeviceBf16 *gate_grad_hi = nullptr, *gate_grad_lo = nullptr;
  // The router's operands as hi/lo bf16 pairs (moe_router_logits_split_cuda): the low part of the
  // MoE input [T, C] (its high part is normed_post) and the fp32 master router weight split
  // [E, C]; remade in the forward and again in the backward, as every layer shares them.
  DeviceBf16 *router_x_lo = nullptr, *router_w_hi = nullptr, *router_w_lo = nullptr;
  // A block's input gradient summed in fp32 [T, C]: the MoE block's (routed experts + router +
  // shared expert), read by post_attention_layernorm's backward, then the mixer's (summed over its
  // projections), read by input_layernorm's backward.
  float* d_mixer_input_f32 = nullptr;
};

}  // namespace deltamoe
