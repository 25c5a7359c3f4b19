// The tokens of a batch grouped by id, built on the host with the batch: the embedding backward
// then sums each table row's tokens in one block, in position order (deterministic, no atomics).
#pragma once

#include <cstdint>
#include <vector>

namespace deltamoe {

struct EmbeddingGradPlan {
  std::vector<int32_t> sorted_tokens;    // [T'] token positions by id, ascending position within an id
  std::vector<int32_t> segment_offsets;  // [U+1] tokens of id segment_ids[u]: [offsets[u], offsets[u+1])
  std::vector<int64_t> segment_ids;      // [U] distinct ids, ascending
};

// ids [T]; ids outside [0, vocab) are left out (they have no row to add to).
EmbeddingGradPlan embedding_grad_plan(const int64_t* ids, int64_t num_tokens, int64_t vocab);

}  // namespace deltamoe
