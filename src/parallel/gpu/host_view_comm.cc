// HostViewComm: DeviceMirror (device copies of a call's host ranges) and the adapter.
#include "parallel/gpu/host_view_comm.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_alloc.h"

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
      b.device = device_malloc(std::max<size_t>(b.bytes, 1), "host view comm: device copy");
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
    RAISE("host view: a pointer outside the ranges mirrored for this call");
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
    return make_host_view_comm(ref, std::move(child));
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

}  // namespace

std::unique_ptr<Communicator> make_host_view_comm(Communicator& device_comm, std::unique_ptr<Communicator> owned) {
  return std::make_unique<HostViewComm>(device_comm, std::move(owned));
}

}  // namespace deltamoe
