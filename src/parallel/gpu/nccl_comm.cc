// NcclComm over NCCL 2.28's nonblocking communicators. Every NCCL call is checked; a call that
// returns ncclInProgress (init, split, group end, and collectives while NCCL connects) is waited
// for by polling ncclCommGetAsyncError, and synchronize() polls a CUDA event; each loop checks the
// job's abort flag and the deadline. ncclCommAbort is only called by the thread that owns the
// communicator (inside such a poll or on a failed call), so no NCCL call races it.
#include "parallel/gpu/nccl_comm.h"

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "core/cuda_check.h"
#include "core/device_alloc.h"
#include "core/log.h"
#include "parallel/control_plane.h"

namespace deltamoe {
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// NCCL must never enable NVLink multicast (it can take a shared machine's GPUs out of service);
// NCCL reads the variable when its first communicator is made.
void forbid_nvls() {
  const char* current = std::getenv("NCCL_NVLS_ENABLE");
  if (current != nullptr && std::strcmp(current, "0") != 0) {
    log_warn("NCCL_NVLS_ENABLE=", current, " overridden to 0: deltamoe never requests NVLink multicast");
  }
  CHECK(::setenv("NCCL_NVLS_ENABLE", "0", 1) == 0, "NCCL: cannot set NCCL_NVLS_ENABLE=0");
}

ncclDataType_t nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::f64: return ncclFloat64;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: return ncclUint8;
    case DType::boolean: return ncclUint8;  // 0/1 bytes; the interface allows only max (logical or)
  }
  RAISE("NCCL: no NCCL type for dtype ", dtype_name(dtype));
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::max ? ncclMax : ncclSum; }

// What a host wait on one NCCL communicator needs to give up cleanly.
struct WaitContext {
  Communicator& host;              // the job's host world: abort flag, abort broadcast
  const std::atomic<bool>& local_abort;
  double timeout_seconds;
  std::string comm_name;
};

// Ends the job: tells every rank through the host world, aborts this NCCL communicator, throws.
[[noreturn]] void give_up(const WaitContext& context, ncclComm_t& comm, std::string reason) {
  context.host.abort(reason);
  if (comm != nullptr) {
    ncclCommAbort(comm);  // its result cannot change what happens next
    comm = nullptr;
  }
  throw CommAborted(reason);
}

// Fails unless `result` is ncclSuccess or ncclInProgress.
void check_call(const WaitContext& context, ncclComm_t& comm, ncclResult_t result, const char* what) {
  if (result == ncclSuccess || result == ncclInProgress) return;
  const char* detail = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  give_up(context, comm,
          str_cat("rank ", context.host.rank(), ": ", what, " on NCCL communicator '", context.comm_name,
                  "' failed: ", ncclGetErrorString(result),
                  detail != nullptr && *detail != '\0' ? str_cat(" (", detail, ")") : std::string()));
}

// One turn of a host wait: the job's abort (from any rank or thread) and the deadline end it.
void poll_once(const WaitContext& context, ncclComm_t& comm, Clock::time_point deadline, const char* what) {
  if (context.local_abort.load() || context.host.aborted()) {
    if (comm != nullptr) {
      ncclCommAbort(comm);
      comm = nullptr;
    }
    context.host.throw_if_aborted();
    throw CommAborted(str_cat("NCCL communicator '", context.comm_name, "' was aborted during ", what));
  }
  if (Clock::now() > deadline) {
    give_up(context, comm,
            str_cat("rank ", context.host.rank(), ": ", what, " on NCCL communicator '", context.comm_name,
                    "' made no progress for ", context.timeout_seconds, " s (DELTAMOE_COMM_TIMEOUT); ",
                    context.host.activity().describe()));
  }
  std::this_thread::sleep_for(std::chrono::microseconds(50));
}

// Waits until NCCL's state for `comm` leaves ncclInProgress; `first` is what the call returned.
void wait_nccl(const WaitContext& context, ncclComm_t& comm, ncclResult_t first, const char* what) {
  check_call(context, comm, first, what);
  ncclResult_t state = first;
  const Clock::time_point deadline = deadline_after(context.timeout_seconds);
  while (state == ncclInProgress) {
    poll_once(context, comm, deadline, what);
    check_call(context, comm, ncclCommGetAsyncError(comm, &state), "ncclCommGetAsyncError");
  }
  check_call(context, comm, state, what);
}

class NcclComm final : public Communicator {
 public:
  // Takes ownership of `comm`, which must be fully initialised.
  NcclComm(Communicator& host, ncclComm_t comm, int rank, int size, std::string name, int device,
           double timeout_seconds)
      : Communicator(rank, size, std::move(name), host.shared_activity()),
        host_(host),
        comm_(comm),
        device_(device),
        timeout_seconds_(timeout_seconds) {
    CUDA_CHECK(cudaEventCreateWithFlags(&sync_event_, cudaEventDisableTiming));
    CUDA_CHECK(cudaStreamCreateWithFlags(&barrier_stream_, cudaStreamNonBlocking));
    barrier_word_ = static_cast<uint32_t*>(device_malloc(sizeof(uint32_t), "nccl comm: barrier word"));
    CUDA_CHECK(cudaMemset(barrier_word_, 0, sizeof(uint32_t)));
  }

  ~NcclComm() override {
    if (sync_event_ != nullptr) cudaEventDestroy(sync_event_);
    if (comm_ != nullptr) release_nccl();
    if (barrier_word_ != nullptr) cudaFree(barrier_word_);
    if (barrier_stream_ != nullptr) cudaStreamDestroy(barrier_stream_);
  }

  void release_nccl() {
    // A healthy communicator is finalized (outstanding work flushed) and destroyed; a failed one
    // aborted. A destructor cannot throw: problems are logged.
    if (!aborted()) {
      ncclResult_t state = ncclCommFinalize(comm_);
      const Clock::time_point deadline = deadline_after(timeout_seconds_);
      while (state == ncclInProgress && Clock::now() < deadline && !host_.aborted()) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
      }
      if (state == ncclSuccess && ncclCommDestroy(comm_) == ncclSuccess) return;
      log_warn("NCCL: communicator '", name(), "' did not finalize (", ncclGetErrorString(state), "); aborting it");
    }
    ncclCommAbort(comm_);
  }

  std::string_view backend() const override { return "nccl"; }

  // Any thread: raises the flags; the owning thread's next poll aborts NCCL.
  void abort(std::string_view reason) override {
    local_abort_.store(true);
    host_.abort(reason);
  }
  bool aborted() const override { return local_abort_.load() || host_.aborted(); }
  ControlPlane& control() override { return host_.control(); }

  void synchronize(CommStream stream) override {
    check_not_aborted();
    CUDA_CHECK(cudaEventRecord(sync_event_, cuda_stream(stream)));
    const WaitContext context = wait_context();
    const Clock::time_point deadline = deadline_after(timeout_seconds_);
    for (;;) {
      const cudaError_t state = cudaEventQuery(sync_event_);
      if (state == cudaSuccess) break;
      CHECK(state == cudaErrorNotReady, "NCCL '", name(), "': waiting for the stream failed: ",
            cudaGetErrorName(state), " (", cudaGetErrorString(state), ")");
      // NCCL reports a peer's failure through the async error while its kernels spin.
      ncclResult_t async = ncclSuccess;
      check_call(context, comm_, ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError");
      check_call(context, comm_, async, "a queued NCCL operation");
      poll_once(context, comm_, deadline, "synchronize");
    }
  }

 protected:
  void do_all_reduce(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                     CommStream stream) override {
    wait(ncclAllReduce(in, out, count, nccl_dtype(dtype), nccl_op(op), comm_, cuda_stream(stream)), "ncclAllReduce");
  }
  void do_reduce_scatter(const void* in, void* out, int64_t count_out, DType dtype, ReduceOp op,
                         CommStream stream) override {
    wait(ncclReduceScatter(in, out, count_out, nccl_dtype(dtype), nccl_op(op), comm_, cuda_stream(stream)),
         "ncclReduceScatter");
  }
  void do_all_gather(const void* in, void* out, int64_t count_in, DType dtype, CommStream stream) override {
    wait(ncclAllGather(in, out, count_in, nccl_dtype(dtype), comm_, cuda_stream(stream)), "ncclAllGather");
  }
  void do_all_to_all(const void* in, void* out, int64_t count_per_peer, DType dtype, CommStream stream) override {
    wait(ncclAlltoAll(in, out, count_per_peer, nccl_dtype(dtype), comm_, cuda_stream(stream)), "ncclAlltoAll");
  }
  void do_broadcast(const void* in, void* out, int64_t count, DType dtype, int root, CommStream stream) override {
    wait(ncclBroadcast(in, out, count, nccl_dtype(dtype), root, comm_, cuda_stream(stream)), "ncclBroadcast");
  }
  void do_group_start() override { check(ncclGroupStart(), "ncclGroupStart"); }
  void do_group_end() override { wait(ncclGroupEnd(), "ncclGroupEnd"); }
  void do_send(const void* data, int64_t count, DType dtype, int peer, CommStream stream) override {
    check(ncclSend(data, count, nccl_dtype(dtype), peer, comm_, cuda_stream(stream)), "ncclSend");
  }
  void do_recv(void* data, int64_t count, DType dtype, int peer, CommStream stream) override {
    check(ncclRecv(data, count, nccl_dtype(dtype), peer, comm_, cuda_stream(stream)), "ncclRecv");
  }
  // A barrier orders the hosts of this communicator's ranks (a split's ranks are not the whole
  // job, so not the control plane's barrier): a one-element all-reduce waited for on the host.
  void do_barrier() override {
    wait(ncclAllReduce(barrier_word_, barrier_word_, 1, ncclUint32, ncclSum, comm_, barrier_stream_),
         "barrier (ncclAllReduce)");
    synchronize(CommStream{barrier_stream_});
  }

  std::unique_ptr<Communicator> do_split(int color, int key, std::string name) override {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    wait(ncclCommSplit(comm_, color == kSplitNoColor ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config),
         "ncclCommSplit");
    if (color == kSplitNoColor) return nullptr;
    // In nonblocking mode NCCL fills the new handle from its own thread once the split has run
    // (the parent's state may read success before that): wait for the handle, then for its state.
    WaitContext context = wait_context();
    context.comm_name = name;
    const Clock::time_point deadline = deadline_after(timeout_seconds_);
    while (std::atomic_ref<ncclComm_t>(child).load() == nullptr) poll_once(context, comm_, deadline, "ncclCommSplit");
    ncclResult_t state = ncclInProgress;
    check_call(context, child, ncclCommGetAsyncError(child, &state), "ncclCommGetAsyncError");
    wait_nccl(context, child, state, "ncclCommSplit (new communicator)");
    int child_rank = 0, child_size = 0;
    check_call(context, child, ncclCommUserRank(child, &child_rank), "ncclCommUserRank");
    check_call(context, child, ncclCommCount(child, &child_size), "ncclCommCount");
    return std::make_unique<NcclComm>(host_, child, child_rank, child_size, std::move(name), device_,
                                      timeout_seconds_);
  }

  void check_not_aborted() const override {
    host_.throw_if_aborted();
    if (local_abort_.load()) throw CommAborted(str_cat("NCCL communicator '", name(), "' was aborted"));
  }

 private:
  static cudaStream_t cuda_stream(CommStream stream) { return static_cast<cudaStream_t>(stream.handle); }
  WaitContext wait_context() const { return WaitContext{host_, local_abort_, timeout_seconds_, name()}; }
  void check(ncclResult_t result, const char* what) { check_call(wait_context(), comm_, result, what); }
  void wait(ncclResult_t result, const char* what) { wait_nccl(wait_context(), comm_, result, what); }

  Communicator& host_;
  ncclComm_t comm_;  // nullptr once aborted
  int device_;
  double timeout_seconds_;
  cudaEvent_t sync_event_ = nullptr;
  cudaStream_t barrier_stream_ = nullptr;
  uint32_t* barrier_word_ = nullptr;
  std::atomic<bool> local_abort_{false};
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_comm(Communicator& host_world, int device, const CommOptions& options) {
  forbid_nvls();
  CUDA_CHECK(cudaSetDevice(device));
  // Rank 0 makes the id; the control plane hands it to every rank.
  std::string mine;
  if (host_world.rank() == 0) {
    ncclUniqueId id;
    const ncclResult_t made = ncclGetUniqueId(&id);
    CHECK(made == ncclSuccess, "NCCL: ncclGetUniqueId failed: ", ncclGetErrorString(made));
    mine.assign(reinterpret_cast<const char*>(&id), sizeof(id));
  }
  const std::vector<std::string> all = host_world.control().all_gather(mine, "NCCL unique id");
  CHECK(!all.empty() && all[0].size() == sizeof(ncclUniqueId), "NCCL: rank 0 sent no unique id");
  ncclUniqueId id;
  std::memcpy(&id, all[0].data(), sizeof(id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const std::atomic<bool> no_local_abort{false};
  const WaitContext context{host_world, no_local_abort, options.timeout_seconds, "nccl world"};
  const ncclResult_t started = ncclCommInitRankConfig(&comm, host_world.size(), id, host_world.rank(), &config);
  check_call(context, comm, started, "ncclCommInitRankConfig");
  ncclResult_t state = started;
  if (state == ncclInProgress) check_call(context, comm, ncclCommGetAsyncError(comm, &state), "ncclCommGetAsyncError");
  wait_nccl(context, comm, state, "ncclCommInitRankConfig");
  return std::make_unique<NcclComm>(host_world, comm, host_world.rank(), host_world.size(), "nccl world", device,
                                    options.timeout_seconds);
}

std::string nccl_runtime_version() {
  int version = 0;
  const ncclResult_t result = ncclGetVersion(&version);
  CHECK(result == ncclSuccess, "NCCL: ncclGetVersion failed: ", ncclGetErrorString(result));
  // NCCL >= 2.9 encodes X.Y.Z as X*10000 + Y*100 + Z.
  return str_cat(version / 10000, ".", (version / 100) % 100, ".", version % 100);
}

}  // namespace deltamoe
