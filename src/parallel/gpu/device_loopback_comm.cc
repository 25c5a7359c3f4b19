// DeviceLoopbackComm: every operation is stream sync -> device-to-pinned copies -> the host
// communicator's operation -> pinned-to-device copies -> stream sync. Staging memory is pinned once
// per size and grows only (the loopback is for tests, outside any planned step).
#include "parallel/gpu/device_loopback_comm.h"

#include <cstring>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_alloc.h"
#include "parallel/thread_comm.h"

namespace deltamoe {
namespace {

// A grow-only pinned host buffer.
class PinnedStaging {
 public:
  PinnedStaging() = default;
  ~PinnedStaging() {
    if (data_ != nullptr) cudaFreeHost(data_);
  }
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;

  char* reserve(size_t bytes) {
    if (bytes > capacity_) {
      if (data_ != nullptr) CUDA_CHECK(cudaFreeHost(data_));
      data_ = nullptr;
      capacity_ = 0;
      data_ = pinned_malloc(bytes, "device loopback comm: staging");
      capacity_ = bytes;
    }
    return static_cast<char*>(data_);
  }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

class DeviceLoopbackComm final : public Communicator {
 public:
  DeviceLoopbackComm(Communicator& host, std::unique_ptr<Communicator> owned_host, int device)
      : Communicator(host.rank(), host.size(), host.name(), host.shared_activity()),
        host_(host),
        owned_host_(std::move(owned_host)),
        device_(device) {}

  std::string_view backend() const override { return "device-loopback"; }
  void abort(std::string_view reason) override { host_.abort(reason); }
  bool aborted() const override { return host_.aborted(); }
  ControlPlane& control() override { return host_.control(); }
  void synchronize(CommStream stream) override { CUDA_CHECK(cudaStreamSynchronize(cuda_stream(stream))); }

 protected:
  void do_all_reduce(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                     CommStream stream) override {
    const size_t bytes = count * dtype_size(dtype);
    char* h_in = in_.reserve(bytes);
    char* h_out = out_.reserve(bytes);
    download(h_in, in, bytes, stream);
    host_.all_reduce(h_in, h_out, count, dtype, op);
    upload(out, h_out, bytes, stream);
  }
  void do_reduce_scatter(const void* in, void* out, int64_t count_out, DType dtype, ReduceOp op,
                         CommStream stream) override {
    const size_t block = count_out * dtype_size(dtype);
    char* h_in = in_.reserve(block * size());
    char* h_out = out_.reserve(block);
    download(h_in, in, block * size(), stream);
    host_.reduce_scatter(h_in, h_out, count_out, dtype, op);
    upload(out, h_out, block, stream);
  }
  void do_all_gather(const void* in, void* out, int64_t count_in, DType dtype, CommStream stream) override {
    const size_t block = count_in * dtype_size(dtype);
    char* h_in = in_.reserve(block);
    char* h_out = out_.reserve(block * size());
    download(h_in, in, block, stream);
    host_.all_gather(h_in, h_out, count_in, dtype);
    upload(out, h_out, block * size(), stream);
  }
  void do_all_to_all(const void* in, void* out, int64_t count_per_peer, DType dtype, CommStream stream) override {
    const size_t bytes = count_per_peer * dtype_size(dtype) * size();
    char* h_in = in_.reserve(bytes);
    char* h_out = out_.reserve(bytes);
    download(h_in, in, bytes, stream);
    host_.all_to_all(h_in, h_out, count_per_peer, dtype);
    upload(out, h_out, bytes, stream);
  }
  void do_broadcast(const void* in, void* out, int64_t count, DType dtype, int root, CommStream stream) override {
    const size_t bytes = count * dtype_size(dtype);
    char* h_in = in_.reserve(bytes);
    char* h_out = out_.reserve(bytes);
    if (rank() == root) download(h_in, in, bytes, stream);
    host_.broadcast(h_in, h_out, count, dtype, root);
    upload(out, h_out, bytes, stream);
  }

  void do_group_start() override { pending_.clear(); }
  void do_send(const void* data, int64_t count, DType dtype, int peer, CommStream stream) override {
    pending_.push_back({true, const_cast<void*>(data), count, dtype, peer, stream});
  }
  void do_recv(void* data, int64_t count, DType dtype, int peer, CommStream stream) override {
    pending_.push_back({false, data, count, dtype, peer, stream});
  }
  void do_group_end() override {
    std::vector<Pending> items = std::move(pending_);
    pending_.clear();
    // One staging area for the whole group, each item at its own offset.
    std::vector<size_t> offsets;
    size_t total = 0;
    for (const Pending& item : items) {
      offsets.push_back(total);
      total += (item.count * dtype_size(item.dtype) + 255) / 256 * 256;
    }
    char* staging = in_.reserve(total);
    for (size_t i = 0; i < items.size(); ++i) {
      if (items[i].is_send) download(staging + offsets[i], items[i].data, items[i].count * dtype_size(items[i].dtype),
                                     items[i].stream);
    }
    host_.group_start();
    for (size_t i = 0; i < items.size(); ++i) {
      if (items[i].is_send) host_.send(staging + offsets[i], items[i].count, items[i].dtype, items[i].peer);
      else host_.recv(staging + offsets[i], items[i].count, items[i].dtype, items[i].peer);
    }
    host_.group_end();
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].is_send) upload(items[i].data, staging + offsets[i], items[i].count * dtype_size(items[i].dtype),
                                    items[i].stream);
    }
  }

  void do_barrier() override { host_.barrier(); }
  std::unique_ptr<Communicator> do_split(int color, int key, std::string name) override {
    std::unique_ptr<Communicator> child = host_.split(color, key, std::move(name));
    if (child == nullptr) return nullptr;
    Communicator& child_ref = *child;
    return std::make_unique<DeviceLoopbackComm>(child_ref, std::move(child), device_);
  }
  void check_not_aborted() const override { host_.throw_if_aborted(); }

 private:
  struct Pending {
    bool is_send;
    void* data;
    int64_t count;
    DType dtype;
    int peer;
    CommStream stream;
  };

  static cudaStream_t cuda_stream(CommStream stream) { return static_cast<cudaStream_t>(stream.handle); }

  // Device -> pinned host, after everything queued on the stream (the input's producer).
  void download(char* host, const void* device, size_t bytes, CommStream stream) {
    if (bytes == 0) return;
    CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, cuda_stream(stream)));
    CUDA_CHECK(cudaStreamSynchronize(cuda_stream(stream)));
  }
  // Pinned host -> device; complete on return, so the staging can be reused at once.
  void upload(void* device, const char* host, size_t bytes, CommStream stream) {
    if (bytes == 0) return;
    CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, cuda_stream(stream)));
    CUDA_CHECK(cudaStreamSynchronize(cuda_stream(stream)));
  }

  Communicator& host_;
  std::unique_ptr<Communicator> owned_host_;  // a split's host communicator; null for the world
  int device_;
  PinnedStaging in_;
  PinnedStaging out_;
  std::vector<Pending> pending_;
};

}  // namespace

std::unique_ptr<Communicator> make_device_loopback_comm(Communicator& host, int device) {
  CUDA_CHECK(cudaSetDevice(device));
  return std::make_unique<DeviceLoopbackComm>(host, nullptr, device);
}

void run_device_loopback(int num_ranks, int device, const std::function<void(Communicator& comm)>& fn,
                         const CommOptions& options) {
  run_thread_comm(
      num_ranks,
      [&](Communicator& host) {
        // The CUDA device is per thread.
        std::unique_ptr<Communicator> comm = make_device_loopback_comm(host, device);
        fn(*comm);
      },
      options);
}

}  // namespace deltamoe
