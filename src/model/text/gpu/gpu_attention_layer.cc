// GpuTextModel's gated attention mixer, forward and backward, following the CPU reference
// (src/model/text/attention_layer.cc): q (with its output gate), k and v projections, per-head
// q / k RMSNorm, M-RoPE, causal attention over the packed sequences (cuDNN's fused SDPA on the
// sm_90a path, our kernel otherwise), the sigmoid output gate and o_proj.
#include <cmath>

#include "kernels/attention/attention_cuda.h"
#include "kernels/cudnn_sdpa/gpu/cudnn_sdpa.h"
#include "kernels/gate_activations/gate_activations_cuda.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/mrope/mrope_cuda.h"
#include "kernels/rms_norm/rms_norm_cuda.h"
#include "model/text/gpu/gpu_text_model.h"

namespace deltamoe {

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

}  // namespace deltamoe
