// run_comm_bench: buffers allocated once, each operation timed with CUDA events on one stream.
#include "parallel/gpu/comm_bench.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "parallel/control_plane.h"
#include "parallel/gpu/device_expert_dispatch.h"

namespace deltamoe {
namespace {

// Uniform routing: each token draws top_k distinct experts.
std::vector<int32_t> uniform_routing(int64_t tokens, int64_t top_k, int64_t experts, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> all(experts), idx;
  idx.reserve(tokens * top_k);
  std::iota(all.begin(), all.end(), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      std::uniform_int_distribution<int64_t> pick(k, experts - 1);
      std::swap(all[k], all[pick(rng)]);
      idx.push_back(all[k]);
    }
  }
  return idx;
}

class Timer {
 public:
  explicit Timer(cudaStream_t stream) : stream_(stream) {
    CUDA_CHECK(cudaEventCreate(&start_));
    CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~Timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  // Median milliseconds of `iterations` runs of fn (each waited for through `comm`).
  double median_ms(Communicator& comm, int iterations, const std::function<void()>& fn) {
    std::vector<double> times;
    for (int i = 0; i < iterations; ++i) {
      CUDA_CHECK(cudaEventRecord(start_, stream_));
      fn();
      CUDA_CHECK(cudaEventRecord(stop_, stream_));
      comm.synchronize(CommStream{stream_});
      CUDA_CHECK(cudaEventSynchronize(stop_));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      times.push_back(ms);
    }
    std::sort(times.begin(), times.end());
    double median = times[times.size() / 2];
    // The slowest rank's median (all ranks take part in every operation).
    comm.control().barrier("comm bench timing");
    std::vector<std::string> all = comm.control().all_gather(std::to_string(median), "comm bench times");
    for (const std::string& t : all) median = std::max(median, std::stod(t));
    return median;
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

}  // namespace

std::vector<CommBenchRow> run_comm_bench(Communicator& comm, int device, const CommBenchOptions& o) {
  CHECK(o.tokens > 0 && o.hidden > 0 && o.top_k > 0 && o.experts >= o.top_k && o.iterations > 0 && o.dense_params >= 0,
        "comm bench: bad sizes");
  CHECK(o.experts % comm.size() == 0, "comm bench: ", o.experts, " experts do not split over ", comm.size(), " ranks");
  CUDA_CHECK(cudaSetDevice(device));
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int n = comm.size();
  const double share = n > 1 ? static_cast<double>(n - 1) / n : 1.0;
  std::vector<CommBenchRow> rows;
  auto add = [&](std::string what, double bytes, double ms) {
    const double algbw = bytes > 0 && ms > 0 ? bytes / (ms * 1e-3) / 1e9 : 0;
    rows.push_back({std::move(what), bytes, ms, algbw, algbw * share});
  };
  {
    Timer timer(stream);
    const int64_t slots = o.tokens * o.top_k;
    DeviceDispatchCapacity capacity;
    capacity.max_tokens = o.tokens;
    capacity.top_k = o.top_k;
    capacity.max_recv_rows = 2 * slots;  // uniform routing receives ~slots rows; 2x leaves room
    capacity.max_row_bytes = o.hidden * 2;
    DeviceExpertDispatcher dispatcher(comm, o.experts, capacity, 1, stream);
    const std::vector<int32_t> routing = uniform_routing(o.tokens, o.top_k, o.experts, o.seed + comm.rank());
    DeviceBuffer idx(routing.size() * sizeof(int32_t));
    CUDA_CHECK(cudaMemcpy(idx.data(), routing.data(), routing.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    DeviceBuffer x(o.tokens * o.hidden * 2), recv(capacity.max_recv_rows * o.hidden * 2), back(slots * o.hidden * 2);
    CUDA_CHECK(cudaMemset(x.data(), 0, x.bytes()));
    const DeviceExpertDispatchPlan* plan = nullptr;
    add("expert exchange: plan (counts, one host sync)", 0,
        timer.median_ms(comm, o.iterations, [&] { plan = &dispatcher.plan(0, idx.as<int32_t>(), o.tokens); }));
    const double row_bytes = static_cast<double>(slots) * o.hidden * 2;
    add("expert exchange: dispatch rows (bf16)", row_bytes, timer.median_ms(comm, o.iterations, [&] {
          dispatcher.dispatch(*plan, x.data(), DType::bf16, o.hidden, false, recv.data());
        }));
    add("expert exchange: combine rows (bf16)", row_bytes, timer.median_ms(comm, o.iterations, [&] {
          dispatcher.combine_in_send_order(*plan, recv.data(), DType::bf16, o.hidden, back.data());
        }));
    // ncclAlltoAll of the same bytes, equal blocks.
    const int64_t per_peer = slots * o.hidden / n;
    DeviceBuffer a2a_in(per_peer * n * 2), a2a_out(per_peer * n * 2);
    add("all_to_all, equal blocks (bf16)", static_cast<double>(per_peer) * n * 2, timer.median_ms(comm, o.iterations, [&] {
          comm.all_to_all(a2a_in.data(), a2a_out.data(), per_peer, DType::bf16, CommStream{stream});
        }));
  }
  if (o.dense_params > 0) {
    Timer timer(stream);
    const int64_t piece = (o.dense_params + n - 1) / n;
    {
      DeviceBuffer grads(piece * n * 4), shard(piece * 4);
      add("dense gradients: reduce_scatter (fp32)", static_cast<double>(piece) * n * 4,
          timer.median_ms(comm, std::min(o.iterations, 5), [&] {
            comm.reduce_scatter(grads.data(), shard.data(), piece, DType::f32, ReduceOp::sum, CommStream{stream});
          }));
    }
    {
      DeviceBuffer weights(piece * n * 2);
      add("dense weights: all_gather (bf16)", static_cast<double>(piece) * n * 2,
          timer.median_ms(comm, std::min(o.iterations, 5), [&] {
            comm.all_gather(weights.as<char>() + comm.rank() * piece * 2, weights.data(), piece, DType::bf16,
                            CommStream{stream});
          }));
    }
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
  return rows;
}

std::string format_comm_bench(const std::vector<CommBenchRow>& rows, int ranks) {
  std::string out = str_cat("| operation (", ranks, " ranks) | MB per rank | ms (median, slowest rank) | algbw GB/s | busbw GB/s |\n",
                            "|---|---|---|---|---|\n");
  for (const CommBenchRow& r : rows) {
    char line[256];
    std::snprintf(line, sizeof(line), "| %s | %.1f | %.3f | %.1f | %.1f |\n", r.what.c_str(), r.bytes_per_rank / 1e6,
                  r.ms, r.algbw_gbs, r.busbw_gbs);
    out += line;
  }
  return out;
}

}  // namespace deltamoe
