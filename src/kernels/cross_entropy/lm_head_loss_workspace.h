// The scratch lm_head_cross_entropy_cuda carves, in plain C++ so that the memory planner
// (train/memory_plan.cc) sizes the step's workspace by the same rule as the kernel checks it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/workspace_carver.h"

namespace deltamoe {

// One bf16 logits chunk [chunk_rows, V]; for listed rows the chunk's gathered hidden states and
// their gradient [chunk_rows, H] (bf16) and labels (int64); each piece 256-byte aligned, in that
// order.
inline size_t lm_head_cross_entropy_workspace_bytes(int64_t chunk_rows, int64_t vocab, int64_t hidden) {
  const size_t n = static_cast<size_t>(chunk_rows);
  return align256(n * static_cast<size_t>(vocab) * 2) + 2 * align256(n * static_cast<size_t>(hidden) * 2) +
         align256(n * sizeof(int64_t));
}

}  // namespace deltamoe
