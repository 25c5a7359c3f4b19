// embedding_grad_plan: a stable sort of the token positions by id.
#include "kernels/embedding/embedding_grad_plan.h"

#include <algorithm>
#include <numeric>

namespace deltamoe {

EmbeddingGradPlan embedding_grad_plan(const int64_t* ids, int64_t num_tokens, int64_t vocab) {
  EmbeddingGradPlan plan;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (ids[t] >= 0 && ids[t] < vocab) plan.sorted_tokens.push_back(static_cast<int32_t>(t));
  }
  std::stable_sort(plan.sorted_tokens.begin(), plan.sorted_tokens.end(),
                   [ids](int32_t a, int32_t b) { return ids[a] < ids[b]; });
  for (size_t k = 0; k < plan.sorted_tokens.size(); ++k) {
    const int64_t id = ids[plan.sorted_tokens[k]];
    if (plan.segment_ids.empty() || plan.segment_ids.back() != id) {
      plan.segment_ids.push_back(id);
      plan.segment_offsets.push_back(static_cast<int32_t>(k));
    }
  }
  plan.segment_offsets.push_back(static_cast<int32_t>(plan.sorted_tokens.size()));
  return plan;
}

}  // namespace deltamoe
