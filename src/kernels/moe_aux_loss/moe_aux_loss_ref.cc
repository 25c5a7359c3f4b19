// Plain CPU reference of the MoE load-balancing loss and its gradient with respect to router logits.
#include "kernels/moe_aux_loss/moe_aux_loss.h"

#include "core/error.h"
#include "kernels/moe_router/moe_router.h"

namespace deltamoe {

template <typename T>
void moe_aux_loss_accumulate_ref(const T* probs, const int32_t* topk_idx, int64_t rows, int64_t num_experts,
                                 int64_t top_k, MoeAuxStats* stats) {
  if (stats->selected_count.empty()) {
    stats->selected_count.assign(num_experts, 0.0);
    stats->prob_sum.assign(num_experts, 0.0);
  }
  CHECK(static_cast<int64_t>(stats->selected_count.size()) == num_experts, "moe_aux_loss: layers disagree on the ",
        "expert count (", stats->selected_count.size(), " vs ", num_experts, ")");
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t slot = 0; slot < top_k; ++slot) {
      const int32_t e = topk_idx[r * top_k + slot];
      CHECK(e >= 0 && e < num_experts, "moe_aux_loss: expert index ", e, " out of range");
      stats->selected_count[e] += 1.0;
    }
    for (int64_t e = 0; e < num_experts; ++e) stats->prob_sum[e] += static_cast<double>(probs[r * num_experts + e]);
  }
  stats->num_rows += rows;
}

double moe_aux_loss_value(const MoeAuxStats& stats) {
  if (stats.num_rows == 0) return 0.0;
  const double rows = static_cast<double>(stats.num_rows);
  double sum = 0;
  for (size_t e = 0; e < stats.prob_sum.size(); ++e)
    sum += (stats.selected_count[e] / rows) * (stats.prob_sum[e] / rows);
  return static_cast<double>(stats.prob_sum.size()) * sum;
}

template <typename T>
void moe_aux_loss_backward_ref(const T* probs, const MoeAuxStats& stats, T d_aux, T* d_logits, int64_t rows) {
  const int64_t num_experts = static_cast<int64_t>(stats.prob_sum.size());
  const double total_rows = static_cast<double>(stats.num_rows);
  // d aux / d p_r[e] = E * f_e / R, the same for every row; then the softmax backward of each row.
  std::vector<T> d_probs(static_cast<size_t>(rows * num_experts));
  for (int64_t e = 0; e < num_experts; ++e) {
    const T per_row = d_aux * T(num_experts * (stats.selected_count[e] / total_rows) / total_rows);
    for (int64_t r = 0; r < rows; ++r) d_probs[r * num_experts + e] = per_row;
  }
  softmax_backward_rows_ref(probs, d_probs.data(), d_logits, rows, num_experts);
}

#define INSTANTIATE(T)                                                                                             \
  template void moe_aux_loss_accumulate_ref<T>(const T*, const int32_t*, int64_t, int64_t, int64_t, MoeAuxStats*); \
  template void moe_aux_loss_backward_ref<T>(const T*, const MoeAuxStats&, T, T*, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace deltamoe
