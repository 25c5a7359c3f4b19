// The order samples are read in one epoch: a Fisher-Yates permutation drawn from Philox with
// (seed, epoch), so any epoch's order can be rebuilt from two numbers (resume, other machines).
#pragma once

#include <cstdint>
#include <vector>

namespace deltamoe {

// Sample indices 0..num_samples-1, permuted when shuffle is true (identity otherwise).
std::vector<int64_t> epoch_order(int64_t num_samples, uint64_t seed, int64_t epoch, bool shuffle);

}  // namespace deltamoe
