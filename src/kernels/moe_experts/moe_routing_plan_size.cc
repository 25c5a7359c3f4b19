// moe_routing_plan_bytes: the plan's pieces, each rounded up to 256 bytes.
#include "kernels/moe_experts/moe_routing_plan_size.h"

#include <algorithm>

namespace deltamoe {

size_t moe_routing_plan_bytes(int64_t num_tokens, int64_t num_experts, int64_t top_k) {
  auto align256 = [](int64_t bytes) { return static_cast<size_t>((bytes + 255) / 256 * 256); };
  const int64_t slots = num_tokens * top_k;
  const int64_t chunks = std::max<int64_t>((slots + kMoeSlotsPerChunk - 1) / kMoeSlotsPerChunk, 1);
  return align256((num_experts + 1) * 4) + 2 * align256(slots * 4) + 2 * align256(chunks * num_experts * 4);
}

}  // namespace deltamoe
