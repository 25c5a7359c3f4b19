// DeviceExpertDispatcher: destination ranks per routed slot (with the routing checks), the
// deterministic routing plan of the routed experts reused over ranks (kernels/moe_experts), one
// exchange of (rows, first invalid slot) per peer, then grouped send/recv of rows with exact counts.
#include "parallel/gpu/device_expert_dispatch.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "core/cuda_check.h"
#include "core/device_alloc.h"
#include "kernels/moe_experts/moe_experts_cuda.h"
#include "kernels/moe_experts/moe_experts_sizes.h"

namespace deltamoe {
namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

// owner[slot] = rank owning the slot's expert; an invalid routing records its smallest slot in
// *bad (atomicMin: the same slot whatever the thread order) and gets owner 0 so the plan stays in range.
__global__ void owner_kernel(const int32_t* topk_idx, int64_t slots, int top_k, int64_t num_experts,
                             int64_t experts_per_rank, int32_t* owner, unsigned long long* bad) {
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (slot >= slots) return;
  const int32_t e = topk_idx[slot];
  bool valid = e >= 0 && e < num_experts;
  const int64_t first = slot - slot % top_k;
  for (int64_t j = first; j < slot && valid; ++j) valid = topk_idx[j] != e;
  owner[slot] = valid ? static_cast<int32_t>(e / experts_per_rank) : 0;
  if (!valid) atomicMin(bad, static_cast<unsigned long long>(slot));
}

// out[2p] = rows for peer p, out[2p+1] = this rank's first invalid slot (-1 if none).
__global__ void counts_kernel(const int32_t* offsets, int ep, const unsigned long long* bad, int64_t* out) {
  const int p = threadIdx.x;
  if (p >= ep) return;
  out[2 * p] = offsets == nullptr ? 0 : offsets[p + 1] - offsets[p];
  const unsigned long long b = *bad;
  out[2 * p + 1] = b == ULLONG_MAX ? -1 : static_cast<int64_t>(b);
}

__global__ void subtract_kernel(const int32_t* in, int32_t offset, int32_t* out, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] - offset;
}

// dst[i] = src[index[i] / divisor] (rows of `words` elements of V), i < rows.
template <typename V>
__global__ void gather_rows_kernel(const V* src, const int32_t* index, int64_t divisor, V* dst, int64_t rows,
                                   int64_t words) {
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < rows * words;
       w += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = w / words;
    dst[w] = src[(index[row] / divisor) * words + w % words];
  }
}

// dst[index[i]] = src[i].
template <typename V>
__global__ void scatter_rows_kernel(const V* src, const int32_t* index, V* dst, int64_t rows, int64_t words) {
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < rows * words;
       w += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = w / words;
    dst[index[row] * words + w % words] = src[w];
  }
}

// The widest word (16, 8, 4, 2 or 1 bytes) that divides the row and aligns every pointer.
int word_bytes(int64_t row_bytes, const void* a, const void* b) {
  for (int w : {16, 8, 4, 2}) {
    if (row_bytes % w == 0 && reinterpret_cast<uintptr_t>(a) % w == 0 && reinterpret_cast<uintptr_t>(b) % w == 0) {
      return w;
    }
  }
  return 1;
}

int grid_for(int64_t words) { return static_cast<int>(std::min<int64_t>(blocks_for(words), 4096)); }

void gather_rows(const void* src, const int32_t* index, int64_t divisor, void* dst, int64_t rows, int64_t row_bytes,
                 cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return;
  const int w = word_bytes(row_bytes, src, dst);
  const int64_t words = row_bytes / w, total = rows * words;
  switch (w) {
    case 16: gather_rows_kernel<<<grid_for(total), kThreads, 0, stream>>>(static_cast<const uint4*>(src), index, divisor, static_cast<uint4*>(dst), rows, words); break;
    case 8: gather_rows_kernel<<<grid_for(total), kThreads, 0, stream>>>(static_cast<const uint2*>(src), index, divisor, static_cast<uint2*>(dst), rows, words); break;
    case 4: gather_rows_kernel<<<grid_for(total), kThreads, 0, stream>>>(static_cast<const uint32_t*>(src), index, divisor, static_cast<uint32_t*>(dst), rows, words); break;
    case 2: gather_rows_kernel<<<grid_for(total), kThreads, 0, stream>>>(static_cast<const uint16_t*>(src), index, divisor, static_cast<uint16_t*>(dst), rows, words); break;
    default: gather_rows_kernel<<<grid_for(total), kThreads, 0, stream>>>(static_cast<const uint8_t*>(src), index, divisor, static_cast<uint8_t*>(dst), rows, words); break;
  }
  CUDA_CHECK_LAUNCH();
}

void scatter_rows(const void* src, const int32_t* index, void* dst, int64_t rows, int64_t row_bytes,
                  cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return;
  const int w = word_bytes(row_bytes, src, dst);
  const int64_t words = row_bytes / w, total = rows * words;
  switch (w) {
    case 16: scatter_rows_kernel<<<grid_for(total), kThreads, 0, stream>>>(static_cast<const uint4*>(src), index, static_cast<uint4*>(dst), rows, words); break;
    case 8: scatter_rows_kernel<<<grid_for(total), kThreads, 0, stream>>>(static_cast<const uint2*>(src), index, static_cast<uint2*>(dst), rows, words); break;
    case 4: scatter_rows_kernel<<<grid_for(total), kThreads, 0, stream>>>(static_cast<const uint32_t*>(src), index, static_cast<uint32_t*>(dst), rows, words); break;
    case 2: scatter_rows_kernel<<<grid_for(total), kThreads, 0, stream>>>(static_cast<const uint16_t*>(src), index, static_cast<uint16_t*>(dst), rows, words); break;
    default: scatter_rows_kernel<<<grid_for(total), kThreads, 0, stream>>>(static_cast<const uint8_t*>(src), index, static_cast<uint8_t*>(dst), rows, words); break;
  }
  CUDA_CHECK_LAUNCH();
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) offsets[i + 1] = offsets[i] + counts[i];
  return offsets;
}

}  // namespace

DeviceExpertDispatcher::DeviceExpertDispatcher(Communicator& ep, int64_t num_experts,
                                               const DeviceDispatchCapacity& capacity, int num_plans,
                                               cudaStream_t stream)
    : ep_(ep), num_experts_(num_experts), capacity_(capacity), stream_(stream) {
  CHECK(num_plans >= 1, "expert dispatch: room for ", num_plans, " plans");
  CHECK(num_experts > 0 && num_experts % ep.size() == 0, "expert parallel: ", num_experts,
        " experts do not split evenly over ", ep.size(), " ranks");
  CHECK(capacity.max_tokens >= 0 && capacity.top_k > 0 && capacity.max_recv_rows >= 0 && capacity.max_row_bytes > 0,
        "expert dispatch: bad capacity (tokens ", capacity.max_tokens, ", top_k ", capacity.top_k, ", receive rows ",
        capacity.max_recv_rows, ", row bytes ", capacity.max_row_bytes, ")");
  experts_per_rank_ = num_experts / ep.size();
  const int64_t slots = capacity.max_tokens * capacity.top_k;
  owner_ = DeviceBuffer(std::max<int64_t>(slots, 1) * sizeof(int32_t));
  counts_ = DeviceBuffer(4 * ep.size() * sizeof(int64_t) + sizeof(unsigned long long));
  send_expert_ = DeviceBuffer(std::max<int64_t>(slots, 1) * sizeof(int32_t));
  staging_ = DeviceBuffer(std::max<int64_t>(slots, 1) * capacity.max_row_bytes);
  plans_.resize(num_plans);
  for (PlanMemory& p : plans_) {
    p.routing = DeviceBuffer(moe_routing_plan_bytes(std::max<int64_t>(slots, 1), ep.size(), 1));
    p.recv_expert = DeviceBuffer(std::max<int64_t>(capacity.max_recv_rows, 1) * sizeof(int32_t));
    p.plan.recv_expert = p.recv_expert.as<int32_t>();
  }
  // The raw handles last, released again if one of them fails (the destructor does not run then).
  try {
    host_counts_ = static_cast<int64_t*>(pinned_malloc(4 * ep.size() * sizeof(int64_t), "expert dispatch: counts"));
    CUDA_CHECK(cudaStreamCreateWithFlags(&counts_stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&counts_exchanged_, cudaEventDisableTiming));
  } catch (...) {
    release_handles();
    throw;
  }
}

void DeviceExpertDispatcher::check_row_bytes(DType dtype, int64_t width) const {
  const int64_t row_bytes = width * static_cast<int64_t>(dtype_size(dtype));
  CHECK(row_bytes <= capacity_.max_row_bytes, "expert dispatch: rows of ", row_bytes, " bytes exceed the capacity of ",
        capacity_.max_row_bytes);
}

DeviceExpertDispatcher::~DeviceExpertDispatcher() { release_handles(); }

void DeviceExpertDispatcher::release_handles() {
  // A started plan's copy may still be in flight into host_counts_: let it land first.
  if (counts_stream_ != nullptr) {
    cudaStreamSynchronize(counts_stream_);
    cudaStreamDestroy(counts_stream_);
  }
  if (counts_exchanged_ != nullptr) cudaEventDestroy(counts_exchanged_);
  if (host_counts_ != nullptr) cudaFreeHost(host_counts_);
}

const DeviceExpertDispatchPlan& DeviceExpertDispatcher::plan(int index, const int32_t* topk_idx, int64_t num_tokens) {
  start_plan(index, topk_idx, num_tokens);
  return finish_plan(index);
}

void DeviceExpertDispatcher::start_plan(int index, const int32_t* topk_idx, int64_t num_tokens) {
  CHECK(index >= 0 && index < static_cast<int>(plans_.size()), "expert dispatch: plan ", index, " of ",
        plans_.size());
  // counts_ and host_counts_ hold one plan's counts: the previous plan must be finished.
  CHECK(started_.index < 0, "expert dispatch: plan ", index, " started while plan ", started_.index,
        " is not finished");
  PlanMemory& memory = plans_[index];
  const int n = ep_.size();
  const int64_t top_k = capacity_.top_k;
  CHECK(num_tokens >= 0 && num_tokens <= capacity_.max_tokens, "expert dispatch: ", num_tokens,
        " tokens exceed the capacity of ", capacity_.max_tokens);
  CHECK(num_tokens == 0 || topk_idx != nullptr, "expert dispatch: topk_idx is null for ", num_tokens, " tokens");
  const int64_t slots = num_tokens * top_k;
  int64_t* counts = counts_.as<int64_t>();  // [2n] sent, then [2n] received
  auto* bad = reinterpret_cast<unsigned long long*>(counts + 4 * n);
  CUDA_CHECK(cudaMemsetAsync(bad, 0xff, sizeof(unsigned long long), stream_));
  // The routing plan's counting sort over flat slots, keyed by destination rank. Several slots of
  // a token may go to one rank, so the slots are planned as single-slot tokens (same flat order).
  MoeRoutingPlan routing = moe_routing_plan_in(memory.routing.data(), std::max<int64_t>(slots, 1), n, 1);
  if (slots > 0) {
    owner_kernel<<<blocks_for(slots), kThreads, 0, stream_>>>(topk_idx, slots, static_cast<int>(top_k), num_experts_,
                                                              experts_per_rank_, owner_.as<int32_t>(), bad);
    CUDA_CHECK_LAUNCH();
    moe_routing_plan_cuda(owner_.as<int32_t>(), routing, slots, n, 1, stream_);
  }
  counts_kernel<<<1, 1024, 0, stream_>>>(slots > 0 ? routing.expert_offsets : nullptr, n, bad, counts);
  CUDA_CHECK_LAUNCH();
  ep_.all_to_all(counts, counts + 2 * n, 2, DType::i64, CommStream{stream_});
  // The copy waits for the exchange, not for what the caller enqueues on stream_ next.
  CUDA_CHECK(cudaEventRecord(counts_exchanged_, stream_));
  CUDA_CHECK(cudaStreamWaitEvent(counts_stream_, counts_exchanged_, 0));
  CUDA_CHECK(cudaMemcpyAsync(host_counts_, counts, 4 * n * sizeof(int64_t), cudaMemcpyDeviceToHost, counts_stream_));
  started_ = StartedPlan{index, topk_idx, num_tokens};
}

const DeviceExpertDispatchPlan& DeviceExpertDispatcher::finish_plan(int index) {
  CHECK(started_.index == index, "expert dispatch: finishing plan ", index, " but ",
        started_.index < 0 ? std::string("none") : str_cat("plan ", started_.index), " was started");
  const StartedPlan started = started_;
  started_ = StartedPlan{};
  PlanMemory& memory = plans_[index];
  DeviceExpertDispatchPlan& result = memory.plan;
  const int n = ep_.size();
  const int64_t top_k = capacity_.top_k;
  const int64_t num_tokens = started.num_tokens, slots = num_tokens * top_k;
  const MoeRoutingPlan routing = moe_routing_plan_in(memory.routing.data(), std::max<int64_t>(slots, 1), n, 1);
  // The plan's one host sync: the counts size every transfer that follows. The communicator's
  // wait polls with its abort and deadline checks; the stream sync after it returns at once then
  // (it covers communicators whose synchronize does not wait).
  ep_.synchronize(CommStream{counts_stream_});
  CUDA_CHECK(cudaStreamSynchronize(counts_stream_));

  // Every rank sees every rank's first invalid slot, so all refuse together with one message.
  for (int p = 0; p < n; ++p) {
    const int64_t bad_slot = host_counts_[2 * n + 2 * p + 1];
    if (bad_slot >= 0) {
      RAISE("expert dispatch: rank ", p, " of '", ep_.name(), "', token ", bad_slot / top_k, " slot ",
            bad_slot % top_k, " routes to an expert outside [0, ", num_experts_, ") or one its token already chose");
    }
  }
  result.num_tokens = num_tokens;
  result.top_k = top_k;
  result.send_slot = routing.sorted_slot;
  result.row_of_slot = routing.row_of_slot;
  result.send_counts.assign(n, 0);
  result.recv_counts.assign(n, 0);
  result.recv_rows = 0;
  for (int p = 0; p < n; ++p) {
    result.send_counts[p] = host_counts_[2 * p];
    result.recv_counts[p] = host_counts_[2 * n + 2 * p];
    result.recv_rows += result.recv_counts[p];
  }
  if (result.recv_rows > capacity_.max_recv_rows) {
    // The capacity is a headroom over the mean, max_tokens x top_k rows (--expert_recv_headroom).
    const double mean = static_cast<double>(std::max<int64_t>(capacity_.max_tokens * capacity_.top_k, 1));
    char needed[32], planned[32];
    std::snprintf(needed, sizeof(needed), "%.2f", std::max(1.0, std::ceil(100.0 * static_cast<double>(result.recv_rows) / mean) / 100));
    std::snprintf(planned, sizeof(planned), "%.2f", static_cast<double>(capacity_.max_recv_rows) / mean);
    const std::string reason =
        str_cat("expert dispatch: rank ", ep_.rank(), " of '", ep_.name(), "' would receive ", result.recv_rows,
                " rows for one layer of this micro-batch, over its capacity of ", capacity_.max_recv_rows, " (",
                planned, "x the mean; the router sends this rank ", needed,
                "x): restart with --expert_recv_headroom ", needed, " or more (or auto with more GPU memory free); "
                "--resume auto continues from the last checkpoint");
    ep_.abort(reason);
    throw CommAborted(reason);
  }
  // The expert id of every row travels with the plan.
  gather_rows(started.topk_idx, routing.sorted_slot, 1, send_expert_.data(), slots, sizeof(int32_t), stream_);
  exchange_rows(send_expert_.data(), result.send_counts, memory.recv_expert.data(), result.recv_counts, DType::i32, 1);
  return result;
}

void DeviceExpertDispatcher::exchange_rows(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                           const std::vector<int64_t>& recv_counts, DType dtype, int64_t width) {
  const int n = ep_.size();
  const int64_t row_bytes = width * static_cast<int64_t>(dtype_size(dtype));
  const std::vector<int64_t> send_off = offsets_of(send_counts), recv_off = offsets_of(recv_counts);
  ep_.group_start();
  for (int p = 0; p < n; ++p) {
    ep_.send(static_cast<const char*>(send) + send_off[p] * row_bytes, send_counts[p] * width, dtype, p,
             CommStream{stream_});
    ep_.recv(static_cast<char*>(recv) + recv_off[p] * row_bytes, recv_counts[p] * width, dtype, p,
             CommStream{stream_});
  }
  ep_.group_end();
}

void DeviceExpertDispatcher::dispatch(const DeviceExpertDispatchPlan& plan, const void* rows, DType dtype,
                                      int64_t width, bool per_slot, void* recv) {
  check_row_bytes(dtype, width);
  const int64_t row_bytes = width * static_cast<int64_t>(dtype_size(dtype));
  gather_rows(rows, plan.send_slot, per_slot ? 1 : plan.top_k, staging_.data(), plan.num_tokens * plan.top_k,
              row_bytes, stream_);
  exchange_rows(staging_.data(), plan.send_counts, recv, plan.recv_counts, dtype, width);
}

void DeviceExpertDispatcher::combine(const DeviceExpertDispatchPlan& plan, const void* recv_rows, DType dtype,
                                     int64_t width, void* slot_rows) {
  check_row_bytes(dtype, width);
  const int64_t row_bytes = width * static_cast<int64_t>(dtype_size(dtype));
  exchange_rows(recv_rows, plan.recv_counts, staging_.data(), plan.send_counts, dtype, width);
  scatter_rows(staging_.data(), plan.send_slot, slot_rows, plan.num_tokens * plan.top_k, row_bytes, stream_);
}

void DeviceExpertDispatcher::local_expert_ids(const DeviceExpertDispatchPlan& plan, int32_t* ids) {
  if (plan.recv_rows == 0) return;
  subtract_kernel<<<blocks_for(plan.recv_rows), kThreads, 0, stream_>>>(
      plan.recv_expert, static_cast<int32_t>(first_local_expert()), ids, plan.recv_rows);
  CUDA_CHECK_LAUNCH();
}

void DeviceExpertDispatcher::combine_in_send_order(const DeviceExpertDispatchPlan& plan, const void* recv_rows,
                                                   DType dtype, int64_t width, void* send_rows) {
  check_row_bytes(dtype, width);
  exchange_rows(recv_rows, plan.recv_counts, send_rows, plan.send_counts, dtype, width);
}

}  // namespace deltamoe
