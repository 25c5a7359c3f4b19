// Model FLOPs of a training step: 6 x the parameters that take part in matmuls per token (routed
// experts: top-k of them; router, shared expert, lm_head included; embedding excluded) plus causal
// attention, 6 x S x Hq x D per token per attention layer (docs/performance.md, "How FLOPs, MFU and
// floors are counted").
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"

namespace deltamoe {

// Matmul parameters one token passes through (forward).
int64_t matmul_params_per_token(const TextConfig& config);
// Training FLOPs (forward + backward) of one step over packed sequences described by cu_seqlens.
double training_step_flops(const TextConfig& config, const std::vector<int32_t>& cu_seqlens);

}  // namespace deltamoe
