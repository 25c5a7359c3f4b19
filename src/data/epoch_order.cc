// Per-epoch sample permutation.
#include "data/epoch_order.h"

#include <numeric>
#include <utility>

#include "core/error.h"
#include "core/rng.h"

namespace deltamoe {

std::vector<int64_t> epoch_order(int64_t num_samples, uint64_t seed, int64_t epoch, bool shuffle) {
  CHECK(num_samples >= 0 && epoch >= 0, "epoch_order: bad arguments (", num_samples, " samples, epoch ", epoch, ")");
  std::vector<int64_t> order(static_cast<size_t>(num_samples));
  std::iota(order.begin(), order.end(), int64_t{0});
  if (!shuffle) return order;
  // A stream per epoch: epochs are independent permutations, not one long sequence.
  Rng rng(seed, static_cast<uint64_t>(epoch));
  for (int64_t i = num_samples - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i) + 1));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

}  // namespace deltamoe
