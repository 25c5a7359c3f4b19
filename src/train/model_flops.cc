// Matmul parameter count and training FLOPs of the text model.
#include "train/model_flops.h"

#include "core/error.h"

namespace deltamoe {

MatmulParamsByPart matmul_params_by_part(const TextConfig& c) {
  const int64_t C = c.hidden_size;
  MatmulParamsByPart p;
  p.gdn = c.conv_dim() * C + c.value_dim() * C + 2 * c.linear_num_value_heads * C + C * c.value_dim();
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, D = c.head_dim;
  p.attention = 2 * Hq * D * C + 2 * Hkv * D * C + C * Hq * D;
  p.moe = c.num_experts * C + c.num_experts_per_tok * 3 * c.moe_intermediate_size * C +
          3 * c.shared_expert_intermediate_size * C + C;
  p.lm_head = c.vocab_size * C;
  return p;
}

int64_t matmul_params_per_token(const TextConfig& c) {
  const MatmulParamsByPart p = matmul_params_by_part(c);
  int64_t total = p.lm_head;
  for (LayerType type : c.layer_types) total += (type == LayerType::linear_attention ? p.gdn : p.attention) + p.moe;
  return total;
}

double attention_core_flops(const TextConfig& c, const std::vector<int32_t>& cu_seqlens) {
  CHECK(cu_seqlens.size() >= 2, "attention_core_flops: cu_seqlens needs at least two entries");
  // Causal attention: S^2 / 2 query-key pairs, QK^T and PV 2 FLOPs each per pair and dim: 2 S^2 Hq D
  // forward, 3x for training = 6 S^2 Hq D per sequence (6 S Hq D per token).
  const double per_pair = 6.0 * static_cast<double>(c.num_attention_heads * c.head_dim);
  double flops = 0.0;
  for (size_t i = 0; i + 1 < cu_seqlens.size(); ++i) {
    const double s = static_cast<double>(cu_seqlens[i + 1] - cu_seqlens[i]);
    flops += per_pair * s * s;
  }
  return flops;
}

double training_step_flops(const TextConfig& c, const std::vector<int32_t>& cu_seqlens) {
  CHECK(cu_seqlens.size() >= 2, "training_step_flops: cu_seqlens needs at least two entries");
  const double tokens = static_cast<double>(cu_seqlens.back() - cu_seqlens.front());
  const double attention_layers = static_cast<double>(c.num_layers_of(LayerType::full_attention));
  return 6.0 * static_cast<double>(matmul_params_per_token(c)) * tokens +
         attention_layers * attention_core_flops(c, cu_seqlens);
}

}  // namespace deltamoe
