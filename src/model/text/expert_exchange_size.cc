// Sizes of expert_exchange_size.h, in the order GpuExpertParallel and DeviceExpertDispatcher carve
// their buffers (each 256-byte aligned).
#include "model/text/expert_exchange_size.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/workspace_carver.h"
#include "kernels/moe_experts/moe_experts_sizes.h"

namespace deltamoe {

int64_t expert_recv_mean_rows(const TextConfig& config, int64_t max_tokens) {
  return max_tokens * config.num_experts_per_tok;
}

int64_t expert_recv_worst_rows(const TextConfig& config, int ep_size, int64_t max_tokens) {
  return static_cast<int64_t>(ep_size) * expert_recv_mean_rows(config, max_tokens);
}

int64_t expert_recv_rows_for(const TextConfig& config, int ep_size, int64_t max_tokens, double headroom) {
  CHECK(headroom == 0 || headroom >= 1, "--expert_recv_headroom must be at least 1 (or auto), got ", headroom);
  const double ratio = headroom > 0 ? headroom : kAutoExpertRecvHeadroom;
  const double rows = std::ceil(ratio * static_cast<double>(expert_recv_mean_rows(config, max_tokens)));
  return std::min(static_cast<int64_t>(rows), expert_recv_worst_rows(config, ep_size, max_tokens));
}

int64_t expert_recv_capacity(const TextConfig& config, int ep_size, int64_t max_tokens, int64_t max_recv_rows) {
  const int64_t worst = expert_recv_worst_rows(config, ep_size, max_tokens);
  return max_recv_rows > 0 ? std::min(max_recv_rows, worst) : worst;
}

size_t expert_exchange_bytes(const TextConfig& config, int ep_size, int64_t max_tokens, int64_t max_recv_rows) {
  const int64_t R = std::max<int64_t>(expert_recv_capacity(config, ep_size, max_tokens, max_recv_rows), 1);
  const int64_t C = config.hidden_size, K = config.num_experts_per_tok, L = config.num_hidden_layers;
  const int64_t slots = std::max<int64_t>(max_tokens * K, 1);
  size_t bytes = 0;
  // The dispatcher: destination ranks, counts, expert ids in send order, staging, and per layer
  // its plan over ranks and the received expert ids.
  bytes += align256(slots * 4) * 2 + align256(4 * ep_size * 8 + 8) + align256(slots * C * 2);
  bytes += static_cast<size_t>(L) * (moe_routing_plan_bytes(slots, ep_size, 1) + align256(R * 4));
  // Per layer the owner's plan of its received rows; the row buffers; the experts' workspace.
  bytes += static_cast<size_t>(L) * moe_routing_plan_bytes(R, config.num_experts / ep_size, 1);
  bytes += 3 * align256(R * C * 2) + 3 * align256(R * 4) + align256(slots * C * 2);
  const MoeExpertsDims local{R, C, config.num_experts / ep_size, 1, config.moe_intermediate_size};
  bytes += std::max(moe_experts_forward_workspace_bytes(local), moe_experts_backward_workspace_bytes(local));
  bytes += shared_expert_pending_bytes(max_tokens, C);
  return bytes;
}

int64_t expert_recv_rows_within(const TextConfig& config, int ep_size, int64_t max_tokens, int64_t min_rows,
                                size_t budget_bytes) {
  CHECK(min_rows >= 1, "expert exchange: a capacity of ", min_rows, " rows");
  int64_t lo = std::min(min_rows, expert_recv_worst_rows(config, ep_size, max_tokens));
  int64_t hi = expert_recv_worst_rows(config, ep_size, max_tokens);
  if (expert_exchange_bytes(config, ep_size, max_tokens, lo) > budget_bytes) return lo;
  // The bytes grow with the rows: the largest capacity within the budget, by bisection.
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (expert_exchange_bytes(config, ep_size, max_tokens, mid) <= budget_bytes) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace deltamoe
