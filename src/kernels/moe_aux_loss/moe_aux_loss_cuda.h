// CUDA load-balancing aux loss (the spec is moe_aux_loss.h): per-expert selection counts and
// probability sums kept on the device in fp64 over all layers, value and backward; deterministic.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace deltamoe {

// Running sums over all layers, device memory owned by the caller: [E] doubles each.
struct MoeAuxDeviceStats {
  double* selected_count = nullptr;
  double* prob_sum = nullptr;
};

// Zeroes the sums (start of a step).
void moe_aux_stats_reset_cuda(const MoeAuxDeviceStats& stats, int64_t num_experts, cudaStream_t stream);

size_t moe_aux_loss_accumulate_workspace_bytes(int64_t rows, int64_t num_experts);

// Adds one layer's rows: probs [R, E] f32, topk_idx int32 [R, K]. The caller counts R (host).
void moe_aux_loss_accumulate_cuda(const float* probs, const int32_t* topk_idx, int64_t rows, int64_t num_experts,
                                  int64_t top_k, const MoeAuxDeviceStats& stats, void* workspace,
                                  size_t workspace_bytes, cudaStream_t stream);

// aux [1] f64 on the device = E * sum_e (count_e / R) (prob_sum_e / R), R = total_rows (0 -> 0).
void moe_aux_loss_value_cuda(const MoeAuxDeviceStats& stats, int64_t num_experts, int64_t total_rows, double* aux,
                             cudaStream_t stream);

// One layer's d_logits [R, E] f32 for a loss d_aux * aux, written (accumulate false) or added to.
void moe_aux_loss_backward_cuda(const float* probs, const MoeAuxDeviceStats& stats, int64_t total_rows, float d_aux,
                                float* d_logits, bool accumulate, int64_t rows, int64_t num_experts,
                                cudaStream_t stream);

}  // namespace deltamoe
