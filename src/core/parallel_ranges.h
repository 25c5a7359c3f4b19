// Splits [0, count) into contiguous ranges, one per hardware thread, for host work whose every
// element is computed on its own (random tensors by counter, dtype conversions): the result does
// not depend on the split or the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace deltamoe {

// Calls fn(begin, end) on disjoint ranges covering [0, count), on up to hardware_concurrency
// threads (the calling thread takes the first range); a count under 2 * min_per_thread stays on
// the calling thread. Returns when every range is done.
template <typename Fn>
void parallel_ranges(int64_t count, int64_t min_per_thread, Fn&& fn) {
  const int64_t hardware = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()));
  const int64_t num_threads = std::max<int64_t>(1, std::min<int64_t>(count / std::max<int64_t>(min_per_thread, 1), hardware));
  const int64_t per_thread = num_threads > 0 ? (count + num_threads - 1) / num_threads : count;
  auto work = [&](int64_t index) {
    const int64_t begin = index * per_thread, end = std::min(count, begin + per_thread);
    if (begin < end) fn(begin, end);
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(num_threads - 1));
  for (int64_t t = 1; t < num_threads; ++t) threads.emplace_back(work, t);
  work(0);
  for (std::thread& thread : threads) thread.join();
}

}  // namespace deltamoe
