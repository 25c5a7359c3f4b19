// DeviceExpertDispatcher over DeviceLoopbackComm against ExpertDispatcher over ThreadComm at the
// same world sizes and inputs: plan (send order, counts, received expert ids), dispatched rows per
// token and per slot (f32 and bf16), and combined rows, all bitwise; a bad routing refused on every
// rank with one message; a plan over the receive capacity aborting the job. The plan in two calls
// (start_plan, finish_plan) over NcclComm (one rank) and MirrorComm: finish_plan waits for the
// counts only, not for work enqueued on the stream after start_plan.
#include <gtest/gtest.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "core/cuda_check.h"
#include "parallel/expert_dispatch.h"
#include "parallel/gpu/device_expert_dispatch.h"
#include "parallel/gpu/device_loopback_comm.h"
#include "parallel/gpu/mirror_comm.h"
#include "parallel/gpu/nccl_comm.h"
#include "parallel/thread_comm.h"

namespace deltamoe {
namespace {

constexpr int64_t kExperts = 16;
constexpr int64_t kTopK = 4;
constexpr int64_t kWidth = 40;  // 160-byte f32 rows, 80-byte bf16 rows

int64_t tokens_of(int rank) { return std::vector<int64_t>{37, 0, 300, 5}[rank % 4]; }

// Distinct random experts per token, seeded by rank.
std::vector<int32_t> routing_of(int rank) {
  std::mt19937 rng(1234 + rank);
  std::vector<int32_t> idx;
  for (int64_t t = 0; t < tokens_of(rank); ++t) {
    std::vector<int32_t> all(kExperts);
    for (int e = 0; e < kExperts; ++e) all[e] = e;
    std::shuffle(all.begin(), all.end(), rng);
    idx.insert(idx.end(), all.begin(), all.begin() + kTopK);
  }
  return idx;
}

std::vector<float> rows_of(int rank, int64_t rows, float salt) {
  std::vector<float> v(rows * kWidth);
  for (size_t i = 0; i < v.size(); ++i) v[i] = salt + static_cast<float>(rank * 100000 + i) * 0.37f;
  return v;
}

// What an owner does to a received row before it goes back (depends on the row's expert).
void transform(std::vector<float>& rows, const std::vector<int32_t>& experts) {
  for (size_t r = 0; r < experts.size(); ++r)
    for (int64_t c = 0; c < kWidth; ++c) rows[r * kWidth + c] = rows[r * kWidth + c] * (experts[r] + 1) + c;
}

std::vector<uint16_t> to_bf16_bits(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &v[i], 4);
    out[i] = static_cast<uint16_t>(bits >> 16);  // truncation: data movement keeps it exactly
  }
  return out;
}

struct RankResult {
  std::vector<int64_t> send_slot, send_counts, recv_counts;
  std::vector<int32_t> recv_expert;
  std::vector<float> recv_tokens, recv_slots, combined;
  std::vector<uint16_t> recv_tokens_bf16;
};

std::vector<RankResult> host_run(int ranks) {
  std::vector<RankResult> results(ranks);
  std::mutex mutex;
  run_thread_comm(ranks, [&](Communicator& comm) {
    const int r = comm.rank();
    const int64_t T = tokens_of(r);
    ExpertDispatcher dispatcher(comm, kExperts);
    const std::vector<int32_t> idx = routing_of(r);
    const ExpertDispatchPlan plan = dispatcher.plan(idx.data(), T, kTopK);
    RankResult out;
    out.send_slot = plan.send_slot;
    out.send_counts = plan.send_counts;
    out.recv_counts = plan.recv_counts;
    out.recv_expert = plan.recv_expert;
    const std::vector<float> per_token = rows_of(r, T, 0.5f), per_slot = rows_of(r, T * kTopK, 7.25f);
    out.recv_tokens.resize(plan.recv_rows() * kWidth);
    out.recv_slots.resize(plan.recv_rows() * kWidth);
    dispatcher.dispatch(plan, per_token.data(), kWidth, false, out.recv_tokens.data());
    dispatcher.dispatch(plan, per_slot.data(), kWidth, true, out.recv_slots.data());
    std::vector<float> back = out.recv_slots;
    transform(back, plan.recv_expert);
    out.combined.resize(T * kTopK * kWidth);
    dispatcher.combine(plan, back.data(), kWidth, out.combined.data());
    out.recv_tokens_bf16 = to_bf16_bits(out.recv_tokens);
    std::lock_guard<std::mutex> lock(mutex);
    results[r] = std::move(out);
  });
  return results;
}

template <typename T>
std::vector<T> download(const void* device, int64_t count) {
  std::vector<T> host(count);
  if (count > 0) CUDA_CHECK(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

template <typename T>
DeviceBuffer upload(const std::vector<T>& host) {
  DeviceBuffer buffer(std::max<size_t>(host.size() * sizeof(T), 1));
  if (!host.empty()) CUDA_CHECK(cudaMemcpy(buffer.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return buffer;
}

DeviceDispatchCapacity capacity_for(int ranks) {
  DeviceDispatchCapacity capacity;
  capacity.max_tokens = 300;
  capacity.top_k = kTopK;
  capacity.max_recv_rows = 300 * kTopK * ranks;
  capacity.max_row_bytes = kWidth * sizeof(float);
  return capacity;
}

class DeviceDispatch : public ::testing::TestWithParam<int> {};

TEST_P(DeviceDispatch, PlanRowsAndCombineEqualTheHostDispatcherBitwise) {
  const int ranks = GetParam();
  const std::vector<RankResult> want = host_run(ranks);
  std::vector<RankResult> got(ranks);
  std::mutex mutex;
  run_device_loopback(ranks, 0, [&](Communicator& comm) {
    const int r = comm.rank();
    const int64_t T = tokens_of(r);
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    {
      DeviceExpertDispatcher dispatcher(comm, kExperts, capacity_for(ranks), 2, stream);
      const DeviceBuffer idx = upload(routing_of(r));
      // An empty plan first, in the other slot and in this one: the plan must not depend on leftovers.
      dispatcher.plan(1, idx.as<int32_t>(), 0);
      dispatcher.plan(0, idx.as<int32_t>(), 0);
      const DeviceExpertDispatchPlan& plan = dispatcher.plan(0, idx.as<int32_t>(), T);
      RankResult out;
      out.send_counts = plan.send_counts;
      out.recv_counts = plan.recv_counts;
      for (int32_t s : download<int32_t>(plan.send_slot, T * kTopK)) out.send_slot.push_back(s);
      out.recv_expert = download<int32_t>(plan.recv_expert, plan.recv_rows);
      const DeviceBuffer per_token = upload(rows_of(r, T, 0.5f)), per_slot = upload(rows_of(r, T * kTopK, 7.25f));
      const DeviceBuffer per_token_bf16 = upload(to_bf16_bits(rows_of(r, T, 0.5f)));
      DeviceBuffer recv_tokens(std::max<int64_t>(plan.recv_rows, 1) * kWidth * 4);
      DeviceBuffer recv_slots(std::max<int64_t>(plan.recv_rows, 1) * kWidth * 4);
      DeviceBuffer recv_bf16(std::max<int64_t>(plan.recv_rows, 1) * kWidth * 2);
      dispatcher.dispatch(plan, per_token.data(), DType::f32, kWidth, false, recv_tokens.data());
      dispatcher.dispatch(plan, per_slot.data(), DType::f32, kWidth, true, recv_slots.data());
      dispatcher.dispatch(plan, per_token_bf16.data(), DType::bf16, kWidth, false, recv_bf16.data());
      CUDA_CHECK(cudaStreamSynchronize(stream));
      out.recv_tokens = download<float>(recv_tokens.data(), plan.recv_rows * kWidth);
      out.recv_slots = download<float>(recv_slots.data(), plan.recv_rows * kWidth);
      out.recv_tokens_bf16 = download<uint16_t>(recv_bf16.data(), plan.recv_rows * kWidth);
      std::vector<float> back = out.recv_slots;
      transform(back, out.recv_expert);
      const DeviceBuffer back_device = upload(back);
      DeviceBuffer combined(std::max<int64_t>(T * kTopK, 1) * kWidth * 4);
      dispatcher.combine(plan, back_device.data(), DType::f32, kWidth, combined.data());
      // The same rows left in send order equal the slot-order result read through send_slot.
      DeviceBuffer send_order(std::max<int64_t>(T * kTopK, 1) * kWidth * 4);
      dispatcher.combine_in_send_order(plan, back_device.data(), DType::f32, kWidth, send_order.data());
      CUDA_CHECK(cudaStreamSynchronize(stream));
      out.combined = download<float>(combined.data(), T * kTopK * kWidth);
      const std::vector<float> in_send_order = download<float>(send_order.data(), T * kTopK * kWidth);
      for (int64_t i = 0; i < T * kTopK; ++i) {
        for (int64_t c = 0; c < kWidth; ++c) {
          ASSERT_EQ(in_send_order[i * kWidth + c], out.combined[out.send_slot[i] * kWidth + c]) << "row " << i;
        }
      }
      std::lock_guard<std::mutex> lock(mutex);
      got[r] = std::move(out);
    }
    CUDA_CHECK(cudaStreamDestroy(stream));
  });
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(got[r].send_slot, want[r].send_slot) << "rank " << r;
    EXPECT_EQ(got[r].send_counts, want[r].send_counts) << "rank " << r;
    EXPECT_EQ(got[r].recv_counts, want[r].recv_counts) << "rank " << r;
    EXPECT_EQ(got[r].recv_expert, want[r].recv_expert) << "rank " << r;
    EXPECT_EQ(got[r].recv_tokens, want[r].recv_tokens) << "rank " << r;
    EXPECT_EQ(got[r].recv_slots, want[r].recv_slots) << "rank " << r;
    EXPECT_EQ(got[r].recv_tokens_bf16, want[r].recv_tokens_bf16) << "rank " << r;
    EXPECT_EQ(got[r].combined, want[r].combined) << "rank " << r;
    EXPECT_FALSE(want[r].combined.empty() && tokens_of(r) > 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, DeviceDispatch, ::testing::Values(1, 2, 4));

TEST(DeviceDispatchRefusals, ABadRoutingIsRefusedOnEveryRankNamingItsRankAndToken) {
  std::vector<std::string> messages(4);
  run_device_loopback(4, 0, [&](Communicator& comm) {
    std::vector<int32_t> idx = routing_of(comm.rank());
    if (comm.rank() == 2) idx[2 * kTopK + 1] = idx[2 * kTopK];  // rank 2's token 2 chooses an expert twice
    const DeviceBuffer device_idx = upload(idx);
    DeviceExpertDispatcher dispatcher(comm, kExperts, capacity_for(4), 1, nullptr);
    try {
      dispatcher.plan(0, device_idx.as<int32_t>(), tokens_of(comm.rank()));
    } catch (const Error& e) {
      messages[comm.rank()] = e.what();
    }
  });
  for (const std::string& m : messages) {
    EXPECT_NE(m.find("rank 2"), std::string::npos) << m;
    EXPECT_NE(m.find("token 2 slot 1"), std::string::npos) << m;
  }
}

TEST(DeviceDispatchRefusals, APlanOverTheReceiveCapacityAbortsTheJob) {
  std::string error;
  try {
    run_device_loopback(2, 0, [&](Communicator& comm) {
      DeviceDispatchCapacity capacity = capacity_for(2);
      capacity.max_recv_rows = 10;  // far below what rank 0 receives from 37 + 0 tokens x 4
      const DeviceBuffer idx = upload(routing_of(comm.rank()));
      DeviceExpertDispatcher dispatcher(comm, kExperts, capacity, 1, nullptr);
      const DeviceExpertDispatchPlan& plan = dispatcher.plan(0, idx.as<int32_t>(), tokens_of(comm.rank()));
      (void)plan;
    });
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("over its capacity of 10"), std::string::npos) << error;
  EXPECT_NE(error.find("--expert_recv_headroom"), std::string::npos) << error;
}

// Holds a stream until released (or 20 s, then records that it was not released in time).
struct StreamHold {
  std::atomic<bool> release{false};
  std::atomic<bool> timed_out{false};
  static void CUDART_CB wait(void* self) {
    auto* hold = static_cast<StreamHold*>(self);
    const auto start = std::chrono::steady_clock::now();
    while (!hold->release.load()) {
      if (std::chrono::steady_clock::now() - start > std::chrono::seconds(20)) {
        hold->timed_out.store(true);
        return;
      }
      std::this_thread::yield();
    }
  }
};

// start_plan, then work on the stream that only ends once finish_plan has returned: finish_plan
// must wait for the counts alone. The plan then equals the one-call plan of the same routing.
void check_finish_waits_for_the_counts_only(Communicator& comm) {
  const int r = comm.rank();
  const int64_t T = tokens_of(r);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    const DeviceBuffer idx = upload(routing_of(r));
    DeviceExpertDispatcher reference(comm, kExperts, capacity_for(comm.size()), 1, stream);
    const DeviceExpertDispatchPlan& want = reference.plan(0, idx.as<int32_t>(), T);
    const std::vector<int32_t> want_recv_expert = download<int32_t>(want.recv_expert, want.recv_rows);
    CUDA_CHECK(cudaStreamSynchronize(stream));

    DeviceExpertDispatcher dispatcher(comm, kExperts, capacity_for(comm.size()), 2, stream);
    StreamHold hold;
    dispatcher.start_plan(1, idx.as<int32_t>(), T);
    CUDA_CHECK(cudaLaunchHostFunc(stream, &StreamHold::wait, &hold));
    const auto start = std::chrono::steady_clock::now();
    const DeviceExpertDispatchPlan& got = dispatcher.finish_plan(1);
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    hold.release.store(true);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_FALSE(hold.timed_out.load()) << "finish_plan waited for the work enqueued after start_plan";
    EXPECT_LT(waited, 10.0);
    EXPECT_EQ(got.send_counts, want.send_counts);
    EXPECT_EQ(got.recv_counts, want.recv_counts);
    EXPECT_EQ(got.recv_rows, want.recv_rows);
    EXPECT_EQ(download<int32_t>(got.send_slot, T * kTopK), download<int32_t>(want.send_slot, T * kTopK));
    EXPECT_EQ(download<int32_t>(got.recv_expert, got.recv_rows), want_recv_expert);
    EXPECT_GT(got.recv_rows, 0);

    // One plan at a time, finished by its own index.
    EXPECT_THROW(dispatcher.finish_plan(1), Error);
    dispatcher.start_plan(0, idx.as<int32_t>(), T);
    EXPECT_THROW(dispatcher.start_plan(1, idx.as<int32_t>(), T), Error);
    EXPECT_THROW(dispatcher.finish_plan(1), Error);
    dispatcher.finish_plan(0);
    CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(DeviceDispatchOverlap, FinishPlanWaitsForTheCountsOnlyOnNccl) {
  std::unique_ptr<Communicator> host = make_solo_comm();
  CommOptions options;
  options.timeout_seconds = 60;
  std::unique_ptr<Communicator> nccl = make_nccl_comm(*host, 0, options);
  check_finish_waits_for_the_counts_only(*nccl);
}

TEST(DeviceDispatchOverlap, FinishPlanWaitsForTheCountsOnlyOnAMirrorWorld) {
  std::unique_ptr<Communicator> host = make_solo_comm();
  std::unique_ptr<Communicator> mirror = make_mirror_comm(*host, 2, 4);
  check_finish_waits_for_the_counts_only(*mirror);
}

}  // namespace
}  // namespace deltamoe
