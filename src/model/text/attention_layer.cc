// Forward and backward of the gated attention mixer, composed from the reference ops.
#include "model/text/attention_layer.h"

#include <cmath>

#include "kernels/attention/attention.h"
#include "kernels/mrope/mrope.h"
#include "kernels/rms_norm/rms_norm.h"
#include "model/text/projection.h"

namespace deltamoe {

Activation attention_layer_forward(const TextConfig& c, const ParamMap& params, const std::string& names,
                                   const TextBatch& batch, const Activation& x, AttentionLayerSaved* s) {
  const std::string p = names + "self_attn.";
  const int64_t T = batch.num_tokens, C = c.hidden_size, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const int64_t D = c.head_dim;
  s->x = x;
  // q_proj rows per head h: [2hD, 2hD + D) query, [2hD + D, 2(h + 1)D) gate.
  Activation q_and_gate(T * Hq * 2 * D);
  project_forward(params, p + "q_proj", x.data(), q_and_gate.data(), T, C, Hq * 2 * D);
  s->q_raw.resize(T * Hq * D);
  s->gate.resize(T * Hq * D);
  for (int64_t row = 0; row < T * Hq; ++row)
    for (int64_t d = 0; d < D; ++d) {
      s->q_raw[row * D + d] = q_and_gate[row * 2 * D + d];
      s->gate[row * D + d] = q_and_gate[row * 2 * D + D + d];
    }
  s->k_raw.resize(T * Hkv * D);
  s->v.resize(T * Hkv * D);
  project_forward(params, p + "k_proj", x.data(), s->k_raw.data(), T, C, Hkv * D);
  project_forward(params, p + "v_proj", x.data(), s->v.data(), T, C, Hkv * D);
  // Norms before RoPE, per head over D.
  s->q.resize(T * Hq * D);
  s->k.resize(T * Hkv * D);
  s->q_rstd.resize(T * Hq);
  s->k_rstd.resize(T * Hkv);
  rms_norm_forward_ref(s->q_raw.data(), param_values(params, p + "q_norm.weight"), s->q.data(), s->q_rstd.data(),
                       T * Hq, D, c.rms_norm_eps);
  rms_norm_forward_ref(s->k_raw.data(), param_values(params, p + "k_norm.weight"), s->k.data(), s->k_rstd.data(),
                       T * Hkv, D, c.rms_norm_eps);
  mrope_forward_ref(batch.rope, s->q.data(), batch.rope_cos.data(), batch.rope_sin.data(), s->q.data(), T, Hq, D);
  mrope_forward_ref(batch.rope, s->k.data(), batch.rope_cos.data(), batch.rope_sin.data(), s->k.data(), T, Hkv, D);
  const AttentionDims dims{T, Hq, Hkv, D};
  s->attn.resize(T * Hq * D);
  s->lse.resize(T * Hq);
  attention_forward_ref(dims, s->q.data(), s->k.data(), s->v.data(), batch.cu_seqlens.data(), batch.num_seqs(),
                        1.0 / std::sqrt(static_cast<double>(D)), s->attn.data(), s->lse.data());
  s->gated.resize(T * Hq * D);
  attention_gate_forward_ref(s->attn.data(), s->gate.data(), s->gated.data(), T * Hq * D);
  Activation y(T * C);
  project_forward(params, p + "o_proj", s->gated.data(), y.data(), T, Hq * D, C);
  return y;
}

Activation attention_layer_backward(const TextConfig& c, const ParamMap& params, ParamMap* grads,
                                    const std::string& names, const TextBatch& batch, const AttentionLayerSaved& s,
                                    const Activation& dy) {
  LayerGrads grad(params, grads);  // grads null: frozen weights, no weight gradients
  const std::string p = names + "self_attn.";
  const int64_t T = batch.num_tokens, C = c.hidden_size, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const int64_t D = c.head_dim;
  Activation d_gated(T * Hq * D);
  project_backward(params, grad, p + "o_proj", s.gated.data(), dy.data(), d_gated.data(), T, Hq * D, C);
  Activation d_attn(T * Hq * D), d_gate(T * Hq * D);
  attention_gate_backward_ref(s.attn.data(), s.gate.data(), d_gated.data(), d_attn.data(), d_gate.data(), T * Hq * D);
  const AttentionDims dims{T, Hq, Hkv, D};
  Activation dq(T * Hq * D), dk(T * Hkv * D), dv(T * Hkv * D);
  attention_backward_ref(dims, s.q.data(), s.k.data(), s.v.data(), s.attn.data(), s.lse.data(), d_attn.data(),
                         batch.cu_seqlens.data(), batch.num_seqs(), 1.0 / std::sqrt(static_cast<double>(D)), dq.data(),
                         dk.data(), dv.data());
  mrope_backward_ref(batch.rope, dq.data(), batch.rope_cos.data(), batch.rope_sin.data(), dq.data(), T, Hq, D);
  mrope_backward_ref(batch.rope, dk.data(), batch.rope_cos.data(), batch.rope_sin.data(), dk.data(), T, Hkv, D);
  Activation dq_raw(T * Hq * D), dk_raw(T * Hkv * D);
  rms_norm_backward_ref(s.q_raw.data(), param_values(params, p + "q_norm.weight"), s.q_rstd.data(), dq.data(),
                        dq_raw.data(), grad.of(p + "q_norm.weight"), T * Hq, D);
  rms_norm_backward_ref(s.k_raw.data(), param_values(params, p + "k_norm.weight"), s.k_rstd.data(), dk.data(),
                        dk_raw.data(), grad.of(p + "k_norm.weight"), T * Hkv, D);
  Activation d_q_and_gate(T * Hq * 2 * D);
  for (int64_t row = 0; row < T * Hq; ++row)
    for (int64_t d = 0; d < D; ++d) {
      d_q_and_gate[row * 2 * D + d] = dq_raw[row * D + d];
      d_q_and_gate[row * 2 * D + D + d] = d_gate[row * D + d];
    }
  Activation dx(T * C), dx_part(T * C);
  project_backward(params, grad, p + "q_proj", s.x.data(), d_q_and_gate.data(), dx.data(), T, C, Hq * 2 * D);
  project_backward(params, grad, p + "k_proj", s.x.data(), dk_raw.data(), dx_part.data(), T, C, Hkv * D);
  add_into(dx, dx_part);
  project_backward(params, grad, p + "v_proj", s.x.data(), dv.data(), dx_part.data(), T, C, Hkv * D);
  add_into(dx, dx_part);
  return dx;
}

}  // namespace deltamoe
