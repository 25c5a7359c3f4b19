// Helpers shared by the attention GPU tests: cu_seqlens from segment lengths (host and device),
// the FLOP count of packed attention, and rounding an fp32 reference output to bf16.
#pragma once

#include <cstdint>
#include <vector>

#include "core/device_buffer.h"
#include "core/tensor.h"

namespace deltamoe {

inline HostTensor cu_seqlens_from_lengths(const std::vector<int>& lengths) {
  HostTensor cu(DType::i32, {static_cast<int64_t>(lengths.size()) + 1});
  int32_t* values = cu.as<int32_t>();
  values[0] = 0;
  for (size_t s = 0; s < lengths.size(); ++s) values[s + 1] = values[s] + lengths[s];
  return cu;
}

inline int64_t total_length(const std::vector<int>& lengths) {
  int64_t total = 0;
  for (int length : lengths) total += length;
  return total;
}

// Forward matmul FLOPs (QK^T and PV, 2 each per multiply-add): causal counts half the square,
// as the baselines do (4 * L^2 / 2 * D * H per segment).
inline double attention_forward_flops(const std::vector<int>& lengths, int64_t num_q_heads, int64_t head_dim,
                                      bool causal) {
  double flops = 0;
  for (int length : lengths) {
    const double square = static_cast<double>(length) * length;
    flops += 4.0 * (causal ? square / 2 : square) * static_cast<double>(head_dim) * static_cast<double>(num_q_heads);
  }
  return flops;
}

inline HostTensor round_to_bf16(const HostTensor& t) { return t.to_dtype(DType::bf16).to_f32(); }

}  // namespace deltamoe
