// MirrorComm (mirror_comm.h): collectives of a world of identical ranks as device copies and one
// reduction kernel.
#include "parallel/gpu/mirror_comm.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/error.h"
#include "parallel/control_plane.h"

namespace deltamoe {
namespace {

// Rank-ordered sum of `copies` equal values in the element type's arithmetic (reduce.h): 16-bit
// floats are widened, added in f32 and rounded at every step, the others add in their own type.
template <typename T>
__global__ void sum_of_copies_kernel(const T* in, T* out, int64_t count, int copies) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const T x = in[i];
    T acc = x;
    for (int r = 1; r < copies; ++r) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        acc = __float2bfloat16(__bfloat162float(acc) + __bfloat162float(x));
      } else if constexpr (std::is_same_v<T, __half>) {
        acc = __float2half(__half2float(acc) + __half2float(x));
      } else {
        acc = acc + x;
      }
    }
    out[i] = acc;
  }
}

template <typename T>
void launch_sum(const void* in, void* out, int64_t count, int copies, cudaStream_t stream) {
  if (count == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((count + threads - 1) / threads, 4096);
  sum_of_copies_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(static_cast<const T*>(in),
                                                                                 static_cast<T*>(out), count, copies);
  CUDA_CHECK_LAUNCH();
}

// The control plane of the mirror world: every rank contributes what this one does.
class MirrorControlPlane final : public ControlPlane {
 public:
  MirrorControlPlane(ControlPlane& host, int rank, int size) : host_(host), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void barrier(std::string_view label) override {}
  std::vector<std::string> all_gather(std::string_view mine, std::string_view label) override {
    return std::vector<std::string>(static_cast<size_t>(size_), std::string(mine));
  }
  void abort(std::string_view reason) override { host_.abort(reason); }

 private:
  ControlPlane& host_;
  int rank_, size_;
};

class MirrorComm final : public Communicator {
 public:
  MirrorComm(Communicator& host, int rank, int size, std::string name)
      : Communicator(rank, size, std::move(name), host.shared_activity()),
        host_(host),
        control_(std::make_shared<MirrorControlPlane>(host.control(), rank, size)) {}
  MirrorComm(Communicator& host, std::shared_ptr<MirrorControlPlane> control, int rank, int size, std::string name)
      : Communicator(rank, size, std::move(name), host.shared_activity()), host_(host), control_(std::move(control)) {}

  std::string_view backend() const override { return "mirror"; }
  bool mirrored() const override { return true; }
  void abort(std::string_view reason) override { host_.abort(reason); }
  bool aborted() const override { return host_.aborted(); }
  ControlPlane& control() override { return *control_; }
  void synchronize(CommStream stream) override { CUDA_CHECK(cudaStreamSynchronize(cuda_stream(stream))); }

 protected:
  void do_all_reduce(const void* in, void* out, int64_t count, DType dtype, ReduceOp op, CommStream stream) override {
    reduce_copies(in, out, count, dtype, op, stream);
  }
  void do_reduce_scatter(const void* in, void* out, int64_t count_out, DType dtype, ReduceOp op,
                         CommStream stream) override {
    const size_t block = static_cast<size_t>(count_out) * dtype_size(dtype);
    reduce_copies(static_cast<const char*>(in) + static_cast<size_t>(rank()) * block, out, count_out, dtype, op,
                  stream);
  }
  void do_all_gather(const void* in, void* out, int64_t count_in, DType dtype, CommStream stream) override {
    const size_t block = static_cast<size_t>(count_in) * dtype_size(dtype);
    for (int p = 0; p < size(); ++p) copy(static_cast<char*>(out) + static_cast<size_t>(p) * block, in, block, stream);
  }
  void do_all_to_all(const void* in, void* out, int64_t count_per_peer, DType dtype, CommStream stream) override {
    const size_t block = static_cast<size_t>(count_per_peer) * dtype_size(dtype);
    const char* own = static_cast<const char*>(in) + static_cast<size_t>(rank()) * block;
    for (int p = 0; p < size(); ++p) copy(static_cast<char*>(out) + static_cast<size_t>(p) * block, own, block, stream);
  }
  void do_broadcast(const void* in, void* out, int64_t count, DType dtype, int root, CommStream stream) override {
    copy(out, in, static_cast<size_t>(count) * dtype_size(dtype), stream);
  }

  void do_group_start() override { pending_.clear(); }
  void do_send(const void* data, int64_t count, DType dtype, int peer, CommStream stream) override {
    pending_.push_back({true, const_cast<void*>(data), count, dtype, peer, stream});
  }
  void do_recv(void* data, int64_t count, DType dtype, int peer, CommStream stream) override {
    pending_.push_back({false, data, count, dtype, peer, stream});
  }
  // A receive from peer p takes, in this order: what this rank sends to itself when the counts
  // agree (the dispatch: a copy routes to this rank what this rank routes to itself), what it sends
  // to p when they agree (a return leg, p sending back what it got), else rows repeated from the
  // group's largest send (the return leg of an unbalanced routing, whose values a copy of this
  // rank cannot know). The bytes moved are always the receive's.
  void do_group_end() override {
    std::vector<Pending> items = std::move(pending_);
    pending_.clear();
    const Pending* largest = nullptr;
    for (const Pending& item : items)
      if (item.is_send && (largest == nullptr || item.count > largest->count)) largest = &item;
    for (const Pending& item : items) {
      if (item.is_send || item.count == 0) continue;
      const size_t element = dtype_size(item.dtype);
      const Pending* source = nullptr;
      for (const int peer : {rank(), item.peer}) {
        for (const Pending& send : items)
          if (source == nullptr && send.is_send && send.peer == peer && send.count == item.count &&
              send.dtype == item.dtype)
            source = &send;
      }
      if (source != nullptr) {
        copy(item.data, source->data, static_cast<size_t>(item.count) * element, item.stream);
        continue;
      }
      CHECK(largest != nullptr && largest->count > 0 && dtype_size(largest->dtype) == element, "mirror comm '",
            name(), "': a receive of ", item.count, " elements from rank ", item.peer,
            " in a group that sends nothing of its element size");
      for (int64_t done = 0; done < item.count; done += largest->count) {
        const int64_t n = std::min(largest->count, item.count - done);
        copy(static_cast<char*>(item.data) + static_cast<size_t>(done) * element, largest->data,
             static_cast<size_t>(n) * element, item.stream);
      }
    }
  }

  void do_barrier() override {}
  std::unique_ptr<Communicator> do_split(int color, int key, std::string name) override {
    if (color == kSplitNoColor) return nullptr;
    (void)key;
    return std::make_unique<MirrorComm>(host_, control_, rank(), size(), std::move(name));
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

  void copy(void* dst, const void* src, size_t bytes, CommStream stream) {
    if (bytes == 0) return;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda_stream(stream)));
  }

  void reduce_copies(const void* in, void* out, int64_t count, DType dtype, ReduceOp op, CommStream stream) {
    if (op == ReduceOp::max || size() == 1) {
      if (in != out) copy(out, in, static_cast<size_t>(count) * dtype_size(dtype), stream);
      return;
    }
    const cudaStream_t s = cuda_stream(stream);
    switch (dtype) {
      case DType::f32: launch_sum<float>(in, out, count, size(), s); break;
      case DType::f64: launch_sum<double>(in, out, count, size(), s); break;
      case DType::bf16: launch_sum<__nv_bfloat16>(in, out, count, size(), s); break;
      case DType::f16: launch_sum<__half>(in, out, count, size(), s); break;
      case DType::i32: launch_sum<int32_t>(in, out, count, size(), s); break;
      case DType::i64: launch_sum<long long>(in, out, count, size(), s); break;
      default: RAISE("mirror comm: no sum for ", dtype_name(dtype));
    }
  }

  Communicator& host_;
  std::shared_ptr<MirrorControlPlane> control_;  // the job's, shared with splits
  std::vector<Pending> pending_;
};

}  // namespace

std::unique_ptr<Communicator> make_mirror_comm(Communicator& host, int rank, int size) {
  CHECK(size >= 1 && rank >= 0 && rank < size, "mirror comm: rank ", rank, " of ", size);
  return std::make_unique<MirrorComm>(host, rank, size, "world");
}

}  // namespace deltamoe
