// The size of the routing plan's device memory (moe_experts_cuda.h), host arithmetic shared by the
// CUDA plan and the memory planner of CPU builds.
#pragma once

#include <cstddef>
#include <cstdint>

namespace deltamoe {

// Flat slots are counted and placed in chunks of this many; each chunk's slots keep their order.
constexpr int kMoeSlotsPerChunk = 256;

// Bytes of the plan's memory (256-byte aligned pieces: expert offsets, two slot maps, two
// per-chunk count tables).
size_t moe_routing_plan_bytes(int64_t num_tokens, int64_t num_experts, int64_t top_k);

}  // namespace deltamoe
