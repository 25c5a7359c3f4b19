// Tools to measure how well-conditioned a parity case is for bf16: the checkpoint with its weights
// rounded as the GPU stores them, and the gradient distance ||a - b|| / ||b|| per tensor.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/model_checkpoint.h"
#include "core/tensor.h"

namespace deltamoe {

// A copy of `checkpoint` whose parameters hold their bf16-rounded values (as f32), except A_log
// and dt_bias, which the GPU reads in fp32 from its master weights. Passthrough tensors are kept.
ModelCheckpoint with_bf16_rounded_weights(const ModelCheckpoint& checkpoint);

// A copy of `checkpoint` with every parameter (A_log and dt_bias too) scaled by (1 + u * relative),
// u uniform in [-1, 1) from Philox(seed): a second draw of "about one bf16 rounding per weight".
ModelCheckpoint with_perturbed_weights(const ModelCheckpoint& checkpoint, double relative, uint64_t seed);

// ||ours - ref|| / ||ref|| over every element (f32 or any float dtype, equal numel checked); a zero
// reference must be matched by zero (else infinity). NaN anywhere gives NaN.
double gradient_distance(const HostTensor& ours, const HostTensor& ref);

// gradient_distance for every name of `ref` (a missing or misshaped `ours` entry throws, naming it).
std::map<std::string, double> gradient_distances(const std::map<std::string, HostTensor>& ours,
                                                 const std::map<std::string, HostTensor>& ref);

// Number of (layer, token) pairs whose SET of top_k experts differs between two routings of the same
// shape (L entries of [T, top_k]); a reordering within the set does not count.
int64_t routing_differences(const std::vector<std::vector<int32_t>>& a, const std::vector<std::vector<int32_t>>& b,
                            int64_t top_k);

}  // namespace deltamoe
