// The routed experts of the MoE block over an expert-parallel group (design §2.6 backend 1): the
// block opened up into route -> plan -> dispatch -> grouped GEMMs of the local experts -> combine.
// Each rank computes its block of experts for the rows every rank routes to them; the source then
// weights and sums its tokens' K rows in slot order, as one rank does, so forward outputs and
// input gradients are bitwise those of the same rank computing all experts itself. The plan of a
// layer (its one host sync) is made in the forward and reused by that layer's backward, which
// dispatches the layer input again instead of keeping the received rows. The forward is two calls
// (start_forward, forward) so that the caller can enqueue independent work (the shared expert)
// for the GPU to run while the host waits for the exchanged counts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/device_buffer.h"
#include "kernels/moe_experts/moe_experts_cuda.h"
#include "model/config.h"
#include "parallel/communicator.h"
#include "parallel/gpu/device_expert_dispatch.h"

namespace deltamoe {

class GpuExpertParallel {
 public:
  // `ep` splits config.num_experts into ep.size() blocks (block r on rank r). max_tokens: tokens
  // of one micro-batch on this rank; max_recv_rows: rows this rank's experts may receive (0: the
  // worst case, every rank's every routed slot, ep.size() x max_tokens x K).
  GpuExpertParallel(Communicator& ep, const TextConfig& config, int64_t max_tokens, int64_t max_recv_rows,
                    cudaStream_t stream);

  // Device bytes the object takes: expert_exchange_bytes (model/text/expert_exchange_size.h), which
  // also counts the shared expert's pending output the text model holds beside it.

  int64_t first_local_expert() const { return dispatcher_.first_local_expert(); }
  int64_t local_experts() const { return dispatcher_.experts_per_rank(); }

  // Layer `layer`'s routed experts: x [T, C], topk_idx [T, K], topk_weight [T, K] -> y [T, C]
  // written (the K weighted outputs summed in slot order, fp32, like moe_experts_forward_cuda).
  // gate_up / down hold this rank's local experts only ([E_local, 2I, C], [E_local, C, I]).
  // Collective over the group, in two calls: start_forward enqueues the layer's plan over ranks and
  // the count exchange and returns at once; forward waits for the counts (the one host sync) and
  // enqueues the rest. What the caller enqueues on the stream between the two runs while the host
  // waits. topk_idx must keep its values until forward has returned.
  void start_forward(int64_t layer, int64_t num_tokens, const int32_t* topk_idx);
  void forward(int64_t layer, const float* topk_weight, const __nv_bfloat16* x, const __nv_bfloat16* gate_up,
               const __nv_bfloat16* down, __nv_bfloat16* y);

  // The backward of the same layer's forward (its plan): dy [T, C] -> dx [T, C] bf16 and
  // d_topk_weight [T, K] f32 written; d_gate_up / d_down (local experts; null: frozen) added to, or
  // written (expert_grads; zeros where no row arrived), with their sums of squares when squares is
  // given (moe_experts_cuda.h). Collective over the group; no host sync.
  void backward(int64_t layer, const float* topk_weight, const __nv_bfloat16* x, const __nv_bfloat16* gate_up,
                const __nv_bfloat16* down, const __nv_bfloat16* dy, __nv_bfloat16* dx, float* d_topk_weight,
                void* d_gate_up, void* d_down, DType grad_dtype,
                WeightGradOutput expert_grads = WeightGradOutput::added_to,
                const ExpertGradSquares* squares = nullptr);

 private:
  MoeExpertsDims local_dims(int64_t rows) const;

  TextConfig config_;
  int64_t max_tokens_;
  int64_t max_recv_rows_;
  cudaStream_t stream_;
  DeviceExpertDispatcher dispatcher_;
  std::vector<const DeviceExpertDispatchPlan*> layer_plans_;
  std::vector<DeviceBuffer> local_plan_memory_;  // per layer: the owner's routing plan of its received rows
  std::vector<MoeRoutingPlan> local_plans_;
  DeviceBuffer recv_x_, recv_dy_, recv_out_;  // [R, C] bf16
  DeviceBuffer recv_weight_, recv_d_weight_;  // [R] f32
  DeviceBuffer local_ids_;                    // [R] int32
  DeviceBuffer send_rows_;                    // [T*K, C] bf16, send order
  DeviceBuffer workspace_;
  size_t workspace_bytes_ = 0;
};

}  // namespace deltamoe
