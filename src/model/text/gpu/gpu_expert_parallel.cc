// GpuExpertParallel: the routed experts of one rank over its expert-parallel group, composed from
// DeviceExpertDispatcher and the routed-expert kernels run on the received rows with K = 1.
#include "model/text/gpu/gpu_expert_parallel.h"

#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/moe_experts/moe_experts_sizes.h"
#include "model/text/expert_exchange_size.h"

namespace deltamoe {
namespace {

DeviceDispatchCapacity dispatch_capacity(const TextConfig& config, int ep_size, int64_t max_tokens,
                                         int64_t max_recv_rows) {
  DeviceDispatchCapacity capacity;
  capacity.max_tokens = max_tokens;
  capacity.top_k = config.num_experts_per_tok;
  capacity.max_recv_rows = expert_recv_capacity(config, ep_size, max_tokens, max_recv_rows);
  capacity.max_row_bytes = config.hidden_size * static_cast<int64_t>(sizeof(__nv_bfloat16));
  return capacity;
}

}  // namespace

GpuExpertParallel::GpuExpertParallel(Communicator& ep, const TextConfig& config, int64_t max_tokens,
                                     int64_t max_recv_rows, cudaStream_t stream)
    : config_(config),
      max_tokens_(max_tokens),
      max_recv_rows_(expert_recv_capacity(config, ep.size(), max_tokens, max_recv_rows)),
      stream_(stream),
      dispatcher_(ep, config.num_experts, dispatch_capacity(config, ep.size(), max_tokens, max_recv_rows),
                  static_cast<int>(config.num_hidden_layers), stream) {
  const int64_t R = max_recv_rows_, C = config.hidden_size, K = config.num_experts_per_tok;
  const int64_t L = config.num_hidden_layers;
  layer_plans_.assign(L, nullptr);
  local_plans_.resize(L);
  for (int64_t l = 0; l < L; ++l)
    local_plan_memory_.emplace_back(moe_routing_plan_bytes(std::max<int64_t>(R, 1), local_experts(), 1));
  recv_x_ = DeviceBuffer(std::max<int64_t>(R, 1) * C * 2);
  recv_dy_ = DeviceBuffer(std::max<int64_t>(R, 1) * C * 2);
  recv_out_ = DeviceBuffer(std::max<int64_t>(R, 1) * C * 2);
  recv_weight_ = DeviceBuffer(std::max<int64_t>(R, 1) * 4);
  recv_d_weight_ = DeviceBuffer(std::max<int64_t>(R, 1) * 4);
  local_ids_ = DeviceBuffer(std::max<int64_t>(R, 1) * 4);
  send_rows_ = DeviceBuffer(std::max<int64_t>(max_tokens * K, 1) * C * 2);
  const MoeExpertsDims local{std::max<int64_t>(R, 1), C, config.num_experts / ep.size(), 1,
                             config.moe_intermediate_size};
  workspace_bytes_ = std::max(moe_experts_forward_workspace_bytes(local), moe_experts_backward_workspace_bytes(local));
  workspace_ = DeviceBuffer(workspace_bytes_);
}

MoeExpertsDims GpuExpertParallel::local_dims(int64_t rows) const {
  return MoeExpertsDims{rows, config_.hidden_size, local_experts(), 1, config_.moe_intermediate_size};
}

void GpuExpertParallel::start_forward(int64_t layer, int64_t num_tokens, const int32_t* topk_idx) {
  CHECK(layer >= 0 && layer < static_cast<int64_t>(layer_plans_.size()), "expert parallel: layer ", layer, " of ",
        layer_plans_.size());
  // The plan being replaced is no longer the backward's.
  layer_plans_[layer] = nullptr;
  dispatcher_.start_plan(static_cast<int>(layer), topk_idx, num_tokens);
}

void GpuExpertParallel::forward(int64_t layer, const float* topk_weight, const __nv_bfloat16* x,
                                const __nv_bfloat16* gate_up, const __nv_bfloat16* down, __nv_bfloat16* y) {
  const int64_t C = config_.hidden_size, K = config_.num_experts_per_tok;
  const DeviceExpertDispatchPlan& plan = dispatcher_.finish_plan(static_cast<int>(layer));
  layer_plans_[layer] = &plan;
  const int64_t num_tokens = plan.num_tokens;
  const int64_t R = plan.recv_rows;
  auto* recv_x = recv_x_.as<__nv_bfloat16>();
  auto* recv_out = recv_out_.as<__nv_bfloat16>();
  dispatcher_.dispatch(plan, x, DType::bf16, C, false, recv_x);
  // The owner groups its received rows by local expert, in receive order within each.
  dispatcher_.local_expert_ids(plan, local_ids_.as<int32_t>());
  MoeRoutingPlan& local = local_plans_[layer];
  local = moe_routing_plan_in(local_plan_memory_[layer].data(), std::max<int64_t>(R, 1), local_experts(), 1);
  if (R > 0) {
    moe_routing_plan_cuda(local_ids_.as<int32_t>(), local, R, local_experts(), 1, stream_);
    // K = 1, weight 1: each received row's expert output, back in receive order.
    moe_experts_forward_cuda(local_dims(R), local, recv_x, nullptr, gate_up, down, recv_out, workspace_.data(),
                             workspace_bytes_, stream_);
  }
  auto* send_rows = send_rows_.as<__nv_bfloat16>();
  dispatcher_.combine_in_send_order(plan, recv_out, DType::bf16, C, send_rows);
  if (num_tokens > 0) moe_combine_cuda(send_rows, plan.row_of_slot, topk_weight, y, num_tokens, C, K, stream_);
}

void GpuExpertParallel::backward(int64_t layer, const float* topk_weight, const __nv_bfloat16* x,
                                 const __nv_bfloat16* gate_up, const __nv_bfloat16* down, const __nv_bfloat16* dy,
                                 __nv_bfloat16* dx, float* d_topk_weight, void* d_gate_up, void* d_down,
                                 DType grad_dtype, WeightGradOutput expert_grads, const ExpertGradSquares* squares) {
  const DeviceExpertDispatchPlan* plan = layer_plans_[layer];
  CHECK(plan != nullptr, "expert parallel: backward of layer ", layer, " without its forward");
  const int64_t C = config_.hidden_size, K = config_.num_experts_per_tok, T = plan->num_tokens;
  const int64_t R = plan->recv_rows;
  auto* recv_x = recv_x_.as<__nv_bfloat16>();
  auto* recv_dy = recv_dy_.as<__nv_bfloat16>();
  auto* recv_dx = recv_out_.as<__nv_bfloat16>();
  float* recv_w = recv_weight_.as<float>();
  float* recv_dw = recv_d_weight_.as<float>();
  dispatcher_.dispatch(*plan, x, DType::bf16, C, false, recv_x);
  dispatcher_.dispatch(*plan, dy, DType::bf16, C, false, recv_dy);
  dispatcher_.dispatch(*plan, topk_weight, DType::f32, 1, true, recv_w);
  // With no row received the call only writes zero gradients (written mode) and returns.
  moe_experts_backward_cuda(local_dims(R), local_plans_[layer], recv_x, recv_w, gate_up, down, recv_dy, recv_dx,
                            recv_dw, d_gate_up, d_down, grad_dtype, workspace_.data(), workspace_bytes_, stream_, nullptr,
                            expert_grads, squares);
  auto* send_rows = send_rows_.as<__nv_bfloat16>();
  dispatcher_.combine_in_send_order(*plan, recv_dx, DType::bf16, C, send_rows);
  if (T > 0) moe_combine_cuda(send_rows, plan->row_of_slot, nullptr, dx, T, C, K, stream_);
  dispatcher_.combine(*plan, recv_dw, DType::f32, 1, d_topk_weight);
}

}  // namespace deltamoe
