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
#include "parallel/gpu/nccl_comm.h"
#include "parallel/thread_comm.h"

namespace deltamoe {
namespace {

// Device copies of the host byte ranges one call touches; overlapping ranges (in-place forms)
// share one device block, so the device call sees the same aliasing as the host call.
class DeviceMirror {
 public:
  struct Span {
    const void* host;
    size_t bytes;
  };
  explicit DeviceMirror(std::vector<Span> spans) {
    std::vector<Span> live;
    for (const Span& s : spans) {
      if (s.host != nullptr) live.push_back(s);
    }
    std::sort(live.begin(), live.end(), [](const Span& a, const Span& b) { return a.host < b.host; });
    for (const Span& s : live) {
      const char* begin = static_cast<const char*>(s.host);
      if (!blocks_.empty() && begin <= blocks_.back().host_begin + blocks_.back().bytes) {
        Block& last = blocks_.back();
        last.bytes = std::max(last.bytes, static_cast<size_t>(begin + s.bytes - last.host_begin));
      } else {
        blocks_.push_back({begin, s.bytes, nullptr});
      }
    }
    for (Block& b : blocks_) {
      CUDA_CHECK(cudaMalloc(&b.device, std::max<size_t>(b.bytes, 1)));
      if (b.bytes > 0) CUDA_CHECK(cudaMemcpy(b.device, b.host_begin, b.bytes, cudaMemcpyHostToDevice));
    }
  }
  ~DeviceMirror() {
    for (Block& b : blocks_) cudaFree(b.device);
  }
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;

  void* device(const void* host) const {
    if (host == nullptr) return nullptr;
    const char* p = static_cast<const char*>(host);
    for (const Block& b : blocks_) {
      if (p >= b.host_begin && p <= b.host_begin + b.bytes) return static_cast<char*>(b.device) + (p - b.host_begin);
    }
    ADD_FAILURE() << "pointer outside the mirrored ranges";
    return nullptr;
  }
  void copy_back(void* host, size_t bytes) const {
    if (bytes > 0) CUDA_CHECK(cudaMemcpy(host, device(host), bytes, cudaMemcpyDeviceToHost));
  }

 private:
  struct Block {
    const char* host_begin;
    size_t bytes;
    void* device;
  };
  std::vector<Block> blocks_;
};

// Host-pointer semantics over a device communicator: each call mirrors its buffers on the GPU,
// runs the device communicator on this rank's stream, waits and copies the outputs back.
class HostViewComm final : public Communicator {
 public:
  HostViewComm(Communicator& device_comm, std::unique_ptr<Communicator> owned)
      : Communicator(device_comm.rank(), device_comm.size(), device_comm.name(), device_comm.shared_activity()),
        inner_(device_comm),
        owned_(std::move(owned)) {
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~HostViewComm() override { cudaStreamDestroy(stream_); }

  std::string_view backend() const override { return inner_.backend(); }
  void abort(std::string_view reason) override { inner_.abort(reason); }
  bool aborted() const override { return inner_.aborted(); }
  ControlPlane& control() override { return inner_.control(); }

 protected:
  void do_all_reduce(const void* in, void* out, int64_t count, DType dtype, ReduceOp op, CommStream) override {
    const size_t bytes = count * dtype_size(dtype);
    DeviceMirror m({{in, bytes}, {out, bytes}});
    inner_.all_reduce(m.device(in), m.device(out), count, dtype, op, s());
    finish(m, out, bytes);
  }
  void do_reduce_scatter(const void* in, void* out, int64_t count_out, DType dtype, ReduceOp op,
                         CommStream) override {
    const size_t block = count_out * dtype_size(dtype);
    DeviceMirror m({{in, block * size()}, {out, block}});
    inner_.reduce_scatter(m.device(in), m.device(out), count_out, dtype, op, s());
    finish(m, out, block);
  }
  void do_all_gather(const void* in, void* out, int64_t count_in, DType dtype, CommStream) override {
    const size_t block = count_in * dtype_size(dtype);
    DeviceMirror m({{in, block}, {out, block * size()}});
    inner_.all_gather(m.device(in), m.device(out), count_in, dtype, s());
    finish(m, out, block * size());
  }
  void do_all_to_all(const void* in, void* out, int64_t count_per_peer, DType dtype, CommStream) override {
    const size_t bytes = count_per_peer * dtype_size(dtype) * size();
    DeviceMirror m({{in, bytes}, {out, bytes}});
    inner_.all_to_all(m.device(in), m.device(out), count_per_peer, dtype, s());
    finish(m, out, bytes);
  }
  void do_broadcast(const void* in, void* out, int64_t count, DType dtype, int root, CommStream) override {
    const size_t bytes = count * dtype_size(dtype);
    DeviceMirror m({{in, bytes}, {out, bytes}});
    inner_.broadcast(m.device(in), m.device(out), count, dtype, root, s());
    finish(m, out, bytes);
  }
  void do_group_start() override { inner_.group_start(); }
  void do_send(const void* data, int64_t count, DType dtype, int peer, CommStream) override {
    const size_t bytes = count * dtype_size(dtype);
    group_.push_back(std::make_unique<DeviceMirror>(std::vector<DeviceMirror::Span>{{data, bytes}}));
    inner_.send(group_.back()->device(data), count, dtype, peer, s());
  }
  void do_recv(void* data, int64_t count, DType dtype, int peer, CommStream) override {
    const size_t bytes = count * dtype_size(dtype);
    group_.push_back(std::make_unique<DeviceMirror>(std::vector<DeviceMirror::Span>{{data, bytes}}));
    receives_.push_back({data, bytes, group_.back().get()});
    inner_.recv(group_.back()->device(data), count, dtype, peer, s());
  }
  void do_group_end() override {
    inner_.group_end();
    inner_.synchronize(s());
    for (const Receive& r : receives_) r.mirror->copy_back(r.host, r.bytes);
    receives_.clear();
    group_.clear();
  }
  void do_barrier() override { inner_.barrier(); }
  std::unique_ptr<Communicator> do_split(int color, int key, std::string name) override {
    std::unique_ptr<Communicator> child = inner_.split(color, key, std::move(name));
    if (child == nullptr) return nullptr;
    Communicator& ref = *child;
    return std::make_unique<HostViewComm>(ref, std::move(child));
  }
  void check_not_aborted() const override { inner_.throw_if_aborted(); }

 private:
  struct Receive {
    void* host;
    size_t bytes;
    DeviceMirror* mirror;
  };
  CommStream s() const { return CommStream{stream_}; }
  void finish(const DeviceMirror& m, void* out, size_t bytes) {
    inner_.synchronize(s());
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    m.copy_back(out, bytes);
  }

  Communicator& inner_;
  std::unique_ptr<Communicator> owned_;
  cudaStream_t stream_ = nullptr;
  std::vector<std::unique_ptr<DeviceMirror>> group_;
  std::vector<Receive> receives_;
};

uint64_t thread_checksum(int ranks) {
  uint64_t checksum = 0;
  std::mutex mutex;
  run_thread_comm(ranks, [&](Communicator& comm) {
    const SelftestResult result = run_comm_selftest(comm);
    std::lock_guard<std::mutex> lock(mutex);
    if (comm.rank() == 0) checksum = result.checksum;
  });
  return checksum;
}

class DeviceLoopbackConformance : public ::testing::TestWithParam<int> {};

TEST_P(DeviceLoopbackConformance, SelftestOnDeviceBuffersGivesTheThreadCommChecksum) {
  const int ranks = GetParam();
  std::mutex mutex;
  std::vector<SelftestResult> results(ranks);
  run_device_loopback(ranks, 0, [&](Communicator& device_comm) {
    EXPECT_EQ(device_comm.backend(), "device-loopback");
    HostViewComm view(device_comm, nullptr);
    SelftestResult result = run_comm_selftest(view);
    std::lock_guard<std::mutex> lock(mutex);
    results[device_comm.rank()] = result;
  });
  const uint64_t want = thread_checksum(ranks);
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
  HostViewComm view(*nccl, nullptr);
  const SelftestResult result = run_comm_selftest(view);
  EXPECT_GT(result.checks, 20);
  EXPECT_EQ(result.checksum, thread_checksum(1)) << result.summary;
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

}  // namespace
}  // namespace deltamoe
