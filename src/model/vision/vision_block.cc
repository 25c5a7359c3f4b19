// A vision block from the reference ops: LayerNorm -> qkv -> 2-D RoPE -> segment attention -> proj
// (+ residual), LayerNorm -> fc1 -> GELU(tanh) -> fc2 (+ residual); and the backward in reverse.
#include "model/vision/vision_block.h"

#include <cmath>

#include "core/error.h"
#include "kernels/bidirectional_attention/bidirectional_attention.h"
#include "kernels/gelu/gelu.h"
#include "kernels/layer_norm/layer_norm.h"
#include "kernels/vision_rope/vision_rope.h"
#include "model/vision/vision_projection.h"

namespace deltamoe {
namespace {

constexpr double kLayerNormEps = 1e-6;

GeluKind block_gelu(const VisionConfig& config) {
  if (config.hidden_act == "gelu_pytorch_tanh") return GeluKind::tanh;
  if (config.hidden_act == "gelu") return GeluKind::exact;
  RAISE("vision config: hidden_act '", config.hidden_act, "' is not supported (gelu_pytorch_tanh or gelu)");
}

template <typename T>
const T* lookup(const VisionParams& params, const std::string& name, int64_t numel) {
  auto it = params.find(name);
  CHECK(it != params.end(), "vision tower: parameter '", name, "' is missing");
  CHECK(it->second.numel() == numel, "vision tower: parameter '", name, "' has ", it->second.numel(),
        " elements, expected ", numel);
  CHECK(it->second.dtype() == DTypeOf<T>::value, "vision tower: parameter '", name, "' is ",
        dtype_name(it->second.dtype()), ", expected ", dtype_name(DTypeOf<T>::value));
  return it->second.template as<T>();
}

}  // namespace

template <typename T>
const T* vision_param(const VisionParams& params, const std::string& name, int64_t numel) {
  return lookup<T>(params, name, numel);
}

template <typename T>
T* vision_param(VisionParams& params, const std::string& name, int64_t numel) {
  return const_cast<T*>(lookup<T>(params, name, numel));
}

template <typename T>
void vision_block_forward(const VisionConfig& config, const VisionParams& params, const std::string& block,
                          const VisionLayout<T>& layout, std::vector<T>& x, VisionBlockSaved<T>& s) {
  const int64_t n = layout.num_patches, c = config.hidden_size, heads = config.num_heads, d = config.head_dim();
  const int64_t inter = config.intermediate_size;
  s.x_in = x;
  s.norm1.resize(n * c), s.mean1.resize(n), s.rstd1.resize(n);
  layer_norm_forward_ref(x.data(), lookup<T>(params, block + "norm1.weight", c), lookup<T>(params, block + "norm1.bias", c),
                         s.norm1.data(), s.mean1.data(), s.rstd1.data(), n, c, kLayerNormEps);
  std::vector<T> qkv(n * 3 * c);
  vision_project_forward(params, block + "attn.qkv", s.norm1.data(), qkv.data(), n, c, 3 * c);
  // qkv rows are [q (H*D) | k | v]; the rotary embedding is applied to q and k.
  s.q.resize(n * c), s.k.resize(n * c), s.v.resize(n * c);
  for (int64_t t = 0; t < n; ++t) {
    std::copy(&qkv[t * 3 * c], &qkv[t * 3 * c] + c, &s.q[t * c]);
    std::copy(&qkv[t * 3 * c] + c, &qkv[t * 3 * c] + 2 * c, &s.k[t * c]);
    std::copy(&qkv[t * 3 * c] + 2 * c, &qkv[t * 3 * c] + 3 * c, &s.v[t * c]);
  }
  vision_rope_forward_ref(s.q.data(), layout.rope_cos.data(), layout.rope_sin.data(), s.q.data(), n, heads, d);
  vision_rope_forward_ref(s.k.data(), layout.rope_cos.data(), layout.rope_sin.data(), s.k.data(), n, heads, d);
  s.attn.resize(n * c), s.lse.resize(n * heads);
  bidirectional_attention_forward_ref(s.q.data(), s.k.data(), s.v.data(), layout.cu_seqlens.data(),
                                      static_cast<int64_t>(layout.cu_seqlens.size()) - 1, s.attn.data(), s.lse.data(),
                                      n, heads, d, 1.0 / std::sqrt(static_cast<double>(d)));
  std::vector<T> proj(n * c);
  vision_project_forward(params, block + "attn.proj", s.attn.data(), proj.data(), n, c, c);
  s.x_mid = x;
  for (int64_t e = 0; e < n * c; ++e) s.x_mid[e] += proj[e];

  s.norm2.resize(n * c), s.mean2.resize(n), s.rstd2.resize(n);
  layer_norm_forward_ref(s.x_mid.data(), lookup<T>(params, block + "norm2.weight", c),
                         lookup<T>(params, block + "norm2.bias", c), s.norm2.data(), s.mean2.data(), s.rstd2.data(), n,
                         c, kLayerNormEps);
  s.fc1.resize(n * inter), s.act.resize(n * inter);
  vision_project_forward(params, block + "mlp.linear_fc1", s.norm2.data(), s.fc1.data(), n, c, inter);
  gelu_forward_ref(block_gelu(config), s.fc1.data(), s.act.data(), n * inter);
  std::vector<T> mlp(n * c);
  vision_project_forward(params, block + "mlp.linear_fc2", s.act.data(), mlp.data(), n, inter, c);
  for (int64_t e = 0; e < n * c; ++e) x[e] = s.x_mid[e] + mlp[e];
}

template <typename T>
void vision_block_backward(const VisionConfig& config, const VisionParams& params, const std::string& block,
                           const VisionLayout<T>& layout, const VisionBlockSaved<T>& s, std::vector<T>& dx,
                           VisionParams& grads) {
  const int64_t n = layout.num_patches, c = config.hidden_size, heads = config.num_heads, d = config.head_dim();
  const int64_t inter = config.intermediate_size;
  // MLP branch: dx is the gradient of both the residual and the MLP output.
  std::vector<T> d_act(n * inter), d_fc1(n * inter), d_norm2(n * c), d_mid(n * c);
  vision_project_backward(params, &grads, block + "mlp.linear_fc2", s.act.data(), dx.data(), d_act.data(), n, inter, c);
  gelu_backward_ref(block_gelu(config), s.fc1.data(), d_act.data(), d_fc1.data(), n * inter);
  vision_project_backward(params, &grads, block + "mlp.linear_fc1", s.norm2.data(), d_fc1.data(), d_norm2.data(), n, c, inter);
  layer_norm_backward_ref(s.x_mid.data(), lookup<T>(params, block + "norm2.weight", c), s.mean2.data(), s.rstd2.data(),
                          d_norm2.data(), d_mid.data(), optional_vision_grad<T>(&grads, block + "norm2.weight", c),
                          optional_vision_grad<T>(&grads, block + "norm2.bias", c), n, c);
  for (int64_t e = 0; e < n * c; ++e) d_mid[e] += dx[e];

  // Attention branch.
  std::vector<T> d_attn(n * c), dq(n * c), dk(n * c), dv(n * c);
  vision_project_backward(params, &grads, block + "attn.proj", s.attn.data(), d_mid.data(), d_attn.data(), n, c, c);
  bidirectional_attention_backward_ref(s.q.data(), s.k.data(), s.v.data(), s.attn.data(), s.lse.data(), d_attn.data(),
                                       layout.cu_seqlens.data(), static_cast<int64_t>(layout.cu_seqlens.size()) - 1,
                                       dq.data(), dk.data(), dv.data(), n, heads, d,
                                       1.0 / std::sqrt(static_cast<double>(d)));
  vision_rope_backward_ref(dq.data(), layout.rope_cos.data(), layout.rope_sin.data(), dq.data(), n, heads, d);
  vision_rope_backward_ref(dk.data(), layout.rope_cos.data(), layout.rope_sin.data(), dk.data(), n, heads, d);
  std::vector<T> d_qkv(n * 3 * c), d_norm1(n * c);
  for (int64_t t = 0; t < n; ++t) {
    std::copy(&dq[t * c], &dq[t * c] + c, &d_qkv[t * 3 * c]);
    std::copy(&dk[t * c], &dk[t * c] + c, &d_qkv[t * 3 * c] + c);
    std::copy(&dv[t * c], &dv[t * c] + c, &d_qkv[t * 3 * c] + 2 * c);
  }
  vision_project_backward(params, &grads, block + "attn.qkv", s.norm1.data(), d_qkv.data(), d_norm1.data(), n, c, 3 * c);
  layer_norm_backward_ref(s.x_in.data(), lookup<T>(params, block + "norm1.weight", c), s.mean1.data(), s.rstd1.data(),
                          d_norm1.data(), dx.data(), optional_vision_grad<T>(&grads, block + "norm1.weight", c),
                          optional_vision_grad<T>(&grads, block + "norm1.bias", c), n, c);
  for (int64_t e = 0; e < n * c; ++e) dx[e] += d_mid[e];
}

#define DELTAMOE_INSTANTIATE(T)                                                                                   \
  template const T* vision_param<T>(const VisionParams&, const std::string&, int64_t);                           \
  template T* vision_param<T>(VisionParams&, const std::string&, int64_t);                                       \
  template void vision_block_forward<T>(const VisionConfig&, const VisionParams&, const std::string&,            \
                                        const VisionLayout<T>&, std::vector<T>&, VisionBlockSaved<T>&);          \
  template void vision_block_backward<T>(const VisionConfig&, const VisionParams&, const std::string&,           \
                                         const VisionLayout<T>&, const VisionBlockSaved<T>&, std::vector<T>&,    \
                                         VisionParams&);
DELTAMOE_INSTANTIATE(float)
DELTAMOE_INSTANTIATE(double)
#undef DELTAMOE_INSTANTIATE

}  // namespace deltamoe
