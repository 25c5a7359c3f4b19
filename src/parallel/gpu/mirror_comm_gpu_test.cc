// MirrorComm against a real world of identical ranks: DeviceLoopbackComm with N ranks all given the
// same inputs returns, on rank r, bitwise what MirrorComm(rank r of N) returns from the one copy —
// for sums in every dtype the simulator uses (rank-ordered, per-step bf16 rounding), max,
// reduce-scatter, all-gather, all-to-all and the dispatcher's grouped send/recv with exact counts.
#include <gtest/gtest.h>
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "parallel/gpu/device_loopback_comm.h"
#include "parallel/control_plane.h"
#include "parallel/gpu/mirror_comm.h"
#include "parallel/thread_comm.h"

namespace deltamoe {
namespace {

constexpr int kRanks = 4;
constexpr int64_t kCount = 1000;  // per block

// The same bytes on every rank: element i of the f32 input is a value whose repeated sum rounds.
std::vector<float> f32_input(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = 0.1f * static_cast<float>(i % 97) + 1e-3f * static_cast<float>(i % 13) - 3.3f;
  return v;
}
std::vector<uint16_t> bf16_input(int64_t n) {
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<uint16_t>(0x3f80 + (i * 37) % 300);  // around 1.0 .. 2^x
  return v;
}
std::vector<int64_t> i64_input(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = i * 1000003 - 77;
  return v;
}
// Send counts to each peer of the grouped exchange (the same on every identical rank).
std::vector<int64_t> send_counts() { return {5, 0, 17, 9}; }

// Every operation on `comm` with identical inputs; the outputs as one byte string.
std::vector<char> exercise(Communicator& comm) {
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int n = comm.size();
  std::vector<char> out;
  auto run = [&](const void* host_in, size_t in_bytes, size_t out_bytes, auto&& op) {
    void* d_in = nullptr;
    void* d_out = nullptr;
    CUDA_CHECK(cudaMalloc(&d_in, std::max<size_t>(in_bytes, 1)));
    CUDA_CHECK(cudaMalloc(&d_out, std::max<size_t>(out_bytes, 1)));
    CUDA_CHECK(cudaMemcpy(d_in, host_in, in_bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(d_out, 0, out_bytes));
    op(d_in, d_out, CommStream{stream});
    comm.synchronize(CommStream{stream});
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<char> host(out_bytes);
    CUDA_CHECK(cudaMemcpy(host.data(), d_out, out_bytes, cudaMemcpyDeviceToHost));
    out.insert(out.end(), host.begin(), host.end());
    CUDA_CHECK(cudaFree(d_in));
    CUDA_CHECK(cudaFree(d_out));
  };
  const std::vector<float> f = f32_input(kCount * n);
  const std::vector<uint16_t> b = bf16_input(kCount * n);
  const std::vector<int64_t> l = i64_input(kCount * n);
  run(f.data(), kCount * 4, kCount * 4, [&](void* in, void* o, CommStream s) {
    comm.all_reduce(in, o, kCount, DType::f32, ReduceOp::sum, s);
  });
  run(b.data(), kCount * 2, kCount * 2, [&](void* in, void* o, CommStream s) {
    comm.all_reduce(in, o, kCount, DType::bf16, ReduceOp::sum, s);
  });
  run(l.data(), kCount * 8, kCount * 8, [&](void* in, void* o, CommStream s) {
    comm.all_reduce(in, o, kCount, DType::i64, ReduceOp::sum, s);
  });
  run(f.data(), kCount * 4, kCount * 4, [&](void* in, void* o, CommStream s) {
    comm.all_reduce(in, o, kCount, DType::f32, ReduceOp::max, s);
  });
  run(f.data(), kCount * 4 * n, kCount * 4, [&](void* in, void* o, CommStream s) {
    comm.reduce_scatter(in, o, kCount, DType::f32, ReduceOp::sum, s);
  });
  run(f.data(), kCount * 4, kCount * 4 * n, [&](void* in, void* o, CommStream s) {
    comm.all_gather(in, o, kCount, DType::f32, s);
  });
  run(l.data(), kCount * 8 * n, kCount * 8 * n, [&](void* in, void* o, CommStream s) {
    comm.all_to_all(in, o, kCount, DType::i64, s);
  });
  // The dispatcher's pattern: block p (counts[p] rows) to peer p; from every peer, counts[rank] rows.
  const std::vector<int64_t> counts = send_counts();
  int64_t total = 0;
  std::vector<int64_t> offset;
  for (int p = 0; p < n; ++p) offset.push_back(total), total += counts[p];
  const int64_t mine = counts[comm.rank()];
  run(f.data(), total * 4, mine * n * 4, [&](void* in, void* o, CommStream s) {
    comm.group_start();
    for (int p = 0; p < n; ++p) {
      comm.send(static_cast<float*>(in) + offset[p], counts[p], DType::f32, p, s);
      comm.recv(static_cast<float*>(o) + p * mine, mine, DType::f32, p, s);
    }
    comm.group_end();
  });
  CUDA_CHECK(cudaStreamDestroy(stream));
  return out;
}

TEST(MirrorComm, EqualsAWorldOfIdenticalRanksBitwise) {
  ASSERT_EQ(static_cast<int>(send_counts().size()), kRanks);
  std::mutex mutex;
  std::vector<std::vector<char>> real(kRanks);
  run_device_loopback(kRanks, 0, [&](Communicator& comm) {
    std::vector<char> got = exercise(comm);
    std::lock_guard<std::mutex> lock(mutex);
    real[comm.rank()] = std::move(got);
  });
  const std::unique_ptr<Communicator> solo = make_solo_comm();
  for (int r = 0; r < kRanks; ++r) {
    const std::unique_ptr<Communicator> mirror = make_mirror_comm(*solo, r, kRanks);
    EXPECT_EQ(mirror->backend(), "mirror");
    const std::vector<char> got = exercise(*mirror);
    ASSERT_EQ(got.size(), real[r].size()) << "rank " << r;
    EXPECT_EQ(std::memcmp(got.data(), real[r].data(), got.size()), 0) << "rank " << r;
    const std::unique_ptr<Communicator> split = mirror->split(0, r, "ep");
    ASSERT_NE(split, nullptr);
    EXPECT_EQ(split->size(), kRanks);
    EXPECT_EQ(split->rank(), r);
    EXPECT_EQ(mirror->split(kSplitNoColor, r, "none"), nullptr);
    // The control plane of a world of copies: N copies of this rank's contribution.
    EXPECT_EQ(mirror->control().size(), kRanks);
    EXPECT_EQ(mirror->control().all_gather("x" + std::to_string(r), "test"),
              std::vector<std::string>(kRanks, "x" + std::to_string(r)));
    EXPECT_EQ(split->control().all_gather("y", "test").size(), static_cast<size_t>(kRanks));
  }
}

// The combine's return leg of an unbalanced routing: from peer p, as many rows as this rank sent
// p (not what it sends itself). The receive is filled with the right number of bytes from this
// rank's sends; a group that sends nothing cannot fill one and is refused.
TEST(MirrorComm, ReturnLegGetsItsBytes) {
  const std::unique_ptr<Communicator> solo = make_solo_comm();
  const std::unique_ptr<Communicator> mirror = make_mirror_comm(*solo, 1, 3);
  const std::vector<float> rows = {1, 2, 3, 4, 5};
  float* send = nullptr;
  float* recv = nullptr;
  CUDA_CHECK(cudaMalloc(&send, 5 * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&recv, 16 * sizeof(float)));
  CUDA_CHECK(cudaMemcpy(send, rows.data(), 5 * sizeof(float), cudaMemcpyHostToDevice));
  mirror->group_start();
  mirror->send(send, 2, DType::f32, 0);      // rows 1, 2 back to rank 0
  mirror->send(send + 2, 3, DType::f32, 1);  // rows 3..5 to itself
  mirror->recv(recv, 7, DType::f32, 0);      // rank 0 returns 7 rows
  mirror->recv(recv + 8, 3, DType::f32, 2);  // rank 2 returns 3: the self send's count
  mirror->group_end();
  std::vector<float> got(16);
  CUDA_CHECK(cudaMemcpy(got.data(), recv, 16 * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + 7), (std::vector<float>{3, 4, 5, 3, 4, 5, 3}));
  EXPECT_EQ(std::vector<float>(got.begin() + 8, got.begin() + 11), (std::vector<float>{3, 4, 5}));
  mirror->group_start();
  mirror->recv(recv, 4, DType::f32, 0);
  EXPECT_THROW(mirror->group_end(), Error);
  CUDA_CHECK(cudaFree(send));
  CUDA_CHECK(cudaFree(recv));
}

}  // namespace
}  // namespace deltamoe
