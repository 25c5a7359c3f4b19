// The kept-intermediates rule (kept_intermediates.h).
#include "train/kept_intermediates.h"

#include <utility>

namespace deltamoe {

KeptIntermediates choose_kept_intermediates(int64_t rows_layers, int64_t gdn_layers, size_t available,
                                            const std::function<size_t(const KeptIntermediates&)>& plan_total) {
  const double rows_ms = kKeptRowsMsPerLayer * static_cast<double>(rows_layers);
  const double gdn_ms = kKeptGdnMsPerLayer * static_cast<double>(gdn_layers);
  KeptIntermediates order[3] = {{true, true}, {true, false}, {false, true}};
  if (gdn_ms > rows_ms) std::swap(order[1], order[2]);
  for (const KeptIntermediates& choice : order) {
    if ((choice.expert_rows && rows_layers <= 0) || (choice.gdn_forward && gdn_layers <= 0)) continue;
    const size_t total = plan_total(choice);
    if (total <= available && available - total >= kKeepMarginBytes) return choice;
  }
  return {};
}

}  // namespace deltamoe
