// Device memory sizes of the routed-expert kernels (moe_experts_cuda.h) and of the grouped GEMM's
// tile prefix: host arithmetic shared by the CUDA code and the memory planners of CPU builds, so a
// plan and the engine it describes agree to the byte.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/moe_experts/moe_experts.h"

namespace deltamoe {

// Flat slots are counted and placed in chunks of this many; each chunk's slots keep their order.
constexpr int kMoeSlotsPerChunk = 256;

// Bytes of the routing plan's memory (256-byte aligned pieces: expert offsets, two slot maps, two
// per-chunk count tables).
size_t moe_routing_plan_bytes(int64_t num_tokens, int64_t num_experts, int64_t top_k);

// Workspace of grouped_gemm_rows_cuda (kernels/grouped_gemm/grouped_gemm_cuda.h): the per-group
// tile prefix, int32 [G + 1].
size_t grouped_gemm_rows_workspace_bytes(int64_t num_groups);

// Workspace of moe_experts_forward_cuda / moe_experts_backward_cuda: the tile prefix, the permuted
// rows, the gate/up products and the activations.
size_t moe_experts_forward_workspace_bytes(const MoeExpertsDims& dims);
size_t moe_experts_backward_workspace_bytes(const MoeExpertsDims& dims);

// The shared expert's output and gate logit held across the expert exchange's wait (fp32 [T, C]
// and [T]; kernels/shared_expert/shared_expert_cuda.h, SharedExpertPending).
size_t shared_expert_pending_bytes(int64_t num_tokens, int64_t hidden);

}  // namespace deltamoe
