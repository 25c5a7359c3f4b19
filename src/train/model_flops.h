// Model FLOPs of a training step: 6 x the parameters that take part in matmuls per token (routed
// experts: top-k of them; router, shared expert, lm_head included; embedding excluded) plus causal
// attention, 6 x S x Hq x D per token per attention layer (docs/performance.md, "How FLOPs, MFU and
// floors are counted").
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"

namespace deltamoe {

// Matmul parameters one token passes through (forward), by part: one GDN mixer, one attention
// mixer, one MoE block (the top-k routed experts, the shared expert with its gate, the router),
// lm_head.
struct MatmulParamsByPart {
  int64_t gdn = 0, attention = 0, moe = 0, lm_head = 0;
};
MatmulParamsByPart matmul_params_by_part(const TextConfig& config);
// Their sum over the model's layers and lm_head.
int64_t matmul_params_per_token(const TextConfig& config);
// Causal attention's FLOPs of one attention layer in a training step (forward + backward) over
// packed sequences: 6 S^2 Hq D per sequence of S tokens.
double attention_core_flops(const TextConfig& config, const std::vector<int32_t>& cu_seqlens);
// Training FLOPs (forward + backward) of one step over packed sequences described by cu_seqlens.
double training_step_flops(const TextConfig& config, const std::vector<int32_t>& cu_seqlens);

}  // namespace deltamoe
