// The device communicators against the host backends: the whole host conformance suite
// (run_comm_selftest) runs through an adapter that mirrors its host buffers on the GPU, so every
// collective, in-place form, grouped send/recv, split and control-plane call of DeviceLoopbackComm
// and NcclComm is checked against the rank-ordered loop, and the job checksum must equal
// ThreadComm's bitwise. NcclComm runs with one rank (NCCL refuses two ranks on one GPU).
#include <gtest/gtest.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "core/cuda_check.h"
#include "parallel/comm_selftest.h"
#include "parallel/gpu/device_loopback_comm.h"
#include "parallel/gpu/host_view_comm.h"
#include "parallel/gpu/nccl_comm.h"
#include "parallel/thread_comm.h"
#include "testing/run_command.h"

namespace deltamoe {
namespace {

class DeviceLoopbackConformance : public ::testing::TestWithParam<int> {};

TEST_P(DeviceLoopbackConformance, SelftestOnDeviceBuffersGivesTheThreadCommChecksum) {
  const int ranks = GetParam();
  std::mutex mutex;
  std::vector<SelftestResult> results(ranks);
  run_device_loopback(ranks, 0, [&](Communicator& device_comm) {
    EXPECT_EQ(device_comm.backend(), "device-loopback");
    const std::unique_ptr<Communicator> view = make_host_view_comm(device_comm);
    SelftestResult result = run_comm_selftest(*view);
    std::lock_guard<std::mutex> lock(mutex);
    results[device_comm.rank()] = result;
  });
  const uint64_t want = thread_comm_selftest_checksum(ranks);
  for (int r = 0; r < ranks; ++r) {
    EXPECT_GT(results[r].checks, 20) << "rank " << r;
    EXPECT_EQ(results[r].checksum, want) << "rank " << r << ": " << results[r].summary;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, DeviceLoopbackConformance, ::testing::Values(1, 2, 3, 4));

// On each rank's own stream and device buffer: a bf16 sum whose per-step rounding depends on the
// order equals the host's rank-ordered reduction bitwise.
TEST(DeviceLoopback, Bf16AllReduceInRankOrderOnEachRanksStream) {
  const int ranks = 4;
  const int64_t count = 4096;
  std::vector<std::vector<uint16_t>> inputs(ranks, std::vector<uint16_t>(count));
  for (int r = 0; r < ranks; ++r) {
    for (int64_t i = 0; i < count; ++i) {
      // Mixed magnitudes: 1, 2^-9, -1, 2^-9 ... make bf16's per-step rounding visible.
      const float v = (i % 4 == r % 4) ? 1.0f : ((i + r) % 3 == 0 ? -1.0f : 0.001953125f * (1 + r));
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      inputs[r][i] = static_cast<uint16_t>(bits >> 16);
    }
  }
  std::vector<uint16_t> want = inputs[0];
  for (int r = 1; r < ranks; ++r) reduce_into(want.data(), inputs[r].data(), count, DType::bf16, ReduceOp::sum);
  std::vector<std::vector<uint16_t>> got(ranks);
  run_device_loopback(ranks, 0, [&](Communicator& comm) {
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    void* buffer = nullptr;
    CUDA_CHECK(cudaMalloc(&buffer, count * 2));
    CUDA_CHECK(cudaMemcpyAsync(buffer, inputs[comm.rank()].data(), count * 2, cudaMemcpyHostToDevice, stream));
    comm.all_reduce(buffer, buffer, count, DType::bf16, ReduceOp::sum, CommStream{stream});
    comm.synchronize(CommStream{stream});
    std::vector<uint16_t> result(count);
    CUDA_CHECK(cudaMemcpy(result.data(), buffer, count * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaFree(buffer));
    CUDA_CHECK(cudaStreamDestroy(stream));
    got[comm.rank()] = std::move(result);
  });
  for (int r = 0; r < ranks; ++r) EXPECT_EQ(got[r], want) << "rank " << r;
}

TEST(NcclComm, OneRankPassesTheSelftestWithTheThreadCommChecksum) {
  const std::string version = nccl_runtime_version();
  std::printf("NCCL runtime %s\n", version.c_str());
  std::unique_ptr<Communicator> host = make_solo_comm();
  CommOptions options;
  options.timeout_seconds = 60;
  std::unique_ptr<Communicator> nccl = make_nccl_comm(*host, 0, options);
  EXPECT_EQ(nccl->backend(), "nccl");
  EXPECT_EQ(nccl->size(), 1);
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  ASSERT_NE(nvls, nullptr);
  EXPECT_STREQ(nvls, "0");
  const std::unique_ptr<Communicator> view = make_host_view_comm(*nccl);
  const SelftestResult result = run_comm_selftest(*view);
  EXPECT_GT(result.checks, 20);
  EXPECT_EQ(result.checksum, thread_comm_selftest_checksum(1)) << result.summary;
}

// abort() from another thread ends a host wait on the NCCL communicator with CommAborted instead
// of waiting for the stream, which a host function holds busy.
TEST(NcclComm, AbortFromAnotherThreadEndsASynchronize) {
  std::unique_ptr<Communicator> host = make_solo_comm();
  CommOptions options;
  options.timeout_seconds = 60;
  std::unique_ptr<Communicator> nccl = make_nccl_comm(*host, 0, options);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // A host callback that waits for a flag keeps the stream busy until the test releases it.
  static std::atomic<bool> release{false};
  release.store(false);
  CUDA_CHECK(cudaLaunchHostFunc(stream, [](void*) { while (!release.load()) std::this_thread::yield(); }, nullptr));
  // NCCL's own kernels stop at an abort; a host function does not, and ncclCommAbort waits for the
  // device: the test releases the stream a second after the abort, so the wait must have seen the
  // abort flag (not the stream finishing) to throw.
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    nccl->abort("test abort");
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    release.store(true);
  });
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(nccl->synchronize(CommStream{stream}), CommAborted);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 10.0);
  aborter.join();
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaStreamDestroy(stream));
  EXPECT_TRUE(nccl->aborted());
}

// The bring-up command of a multi-GPU machine, here with one rank: `deltamoe launch` starts
// `comm-selftest --device cuda --bench true`, which prints the GPU table, runs the checks on
// NcclComm and times the exchange and the dense collectives at full size.
TEST(NcclComm, CommSelftestOnCudaThroughLaunch) {
  const CommandResult result = run_command(deltamoe_binary() +
                                           " launch --nproc_per_node 1 -- comm-selftest --device cuda --bench true");
  std::printf("%s", result.output.c_str());
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("comm-selftest: rank 0: node"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find(", NCCL 2."), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("ranks (nccl), job checksum"), std::string::npos) << result.output;
  for (const char* row : {"| expert exchange: dispatch rows (bf16) |", "| all_to_all, equal blocks (bf16) |",
                          "| dense gradients: reduce_scatter (fp32) |", "| dense weights: all_gather (bf16) |"}) {
    EXPECT_NE(result.output.find(row), std::string::npos) << row;
  }
}

}  // namespace
}  // namespace deltamoe
