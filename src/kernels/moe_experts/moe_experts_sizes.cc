// The sizes of moe_experts_sizes.h, each piece rounded up to 256 bytes as the kernels carve them.
#include "kernels/moe_experts/moe_experts_sizes.h"

#include <algorithm>

#include "core/workspace_carver.h"

namespace deltamoe {
namespace {

constexpr int64_t kBf16 = 2, kF32 = 4;

}  // namespace

size_t moe_routing_plan_bytes(int64_t num_tokens, int64_t num_experts, int64_t top_k) {
  const int64_t slots = num_tokens * top_k;
  const int64_t chunks = std::max<int64_t>((slots + kMoeSlotsPerChunk - 1) / kMoeSlotsPerChunk, 1);
  return align256((num_experts + 1) * 4) + 2 * align256(slots * 4) + 2 * align256(chunks * num_experts * 4);
}

size_t grouped_gemm_rows_workspace_bytes(int64_t num_groups) {
  return static_cast<size_t>(num_groups + 1) * sizeof(int32_t);
}

size_t moe_experts_forward_workspace_bytes(const MoeExpertsDims& d) {
  const int64_t rows = d.num_tokens * d.top_k;
  return align256(static_cast<int64_t>(grouped_gemm_rows_workspace_bytes(d.num_experts))) +
         align256(rows * d.hidden * kBf16) + align256(rows * 2 * d.intermediate * kBf16) +
         align256(rows * d.intermediate * kBf16);
}

size_t moe_experts_backward_workspace_bytes(const MoeExpertsDims& d) {
  const int64_t rows = d.num_tokens * d.top_k;
  return align256(static_cast<int64_t>(grouped_gemm_rows_workspace_bytes(d.num_experts))) +
         2 * align256(rows * d.hidden * kBf16) + align256(rows * 2 * d.intermediate * kBf16) +
         align256(rows * d.intermediate * kF32) + align256(rows * d.intermediate * kBf16);
}

size_t shared_expert_pending_bytes(int64_t num_tokens, int64_t hidden) {
  return align256(num_tokens * hidden * kF32) + align256(num_tokens * kF32);
}

}  // namespace deltamoe
