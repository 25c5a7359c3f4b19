// GpuTextModel's Gated DeltaNet mixer, forward and backward, following the CPU reference
// (src/model/text/gdn_layer.cc) operation for operation: in_proj_qkv / z / b / a, the causal conv1d
// into q | k | v, L2-normalised q and k, the gates, the chunked delta rule, the gated RMSNorm and
// out_proj. The b and a projections' backward runs on bf16 hi/lo pairs (fp32-exact gate gradients).
#include <cmath>
#include <utility>

#include "core/cuda_check.h"
#include "kernels/causal_conv1d/causal_conv1d_cuda.h"
#include "kernels/gated_delta_rule/gated_delta_rule_cuda.h"
#include "kernels/gated_rmsnorm/gated_rmsnorm_cuda.h"
#include "kernels/gdn_gates/gdn_gates_cuda.h"
#include "kernels/gemm/f32_operand_cuda.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/l2norm/l2norm_cuda.h"
#include "model/text/gpu/gpu_text_model.h"
#include "optim/grad_accumulate_cuda.h"

namespace deltamoe {

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

}  // namespace deltamoe
