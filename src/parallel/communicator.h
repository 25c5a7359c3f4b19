// The one communicator interface of deltamoe: collectives, grouped point-to-point, split, abort.
// Shaped after NCCL (buffers as pointers + element counts + dtype, a stream handle, groups of sends
// and receives) so that a device backend fits it unchanged; the host backends (ThreadComm, TcpComm,
// MpiComm) reduce in a fixed rank order and are bitwise interchangeable. See docs/parallel.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "parallel/activity.h"
#include "parallel/reduce.h"

namespace deltamoe {

class ControlPlane;

// The stream an operation is ordered on: a cudaStream_t for device backends; host backends ignore
// it (their operations have completed when the call returns).
struct CommStream {
  void* handle = nullptr;
};

// Thrown by every operation once the job is aborted (by abort() on any rank, a rank that died or
// stopped answering, a missed deadline, or ranks that called different operations). what() names
// the rank at fault and what it was doing. The communicators of an aborted job stay unusable.
class CommAborted : public Error {
 public:
  using Error::Error;
};

// Exit status of a process that ends because its job was aborted (another rank's failure, or a
// deadline), as opposed to 1 for its own error.
inline constexpr int kExitCommAborted = 75;
// Exit status of a rank that the job's abort names as the one at fault (stuck outside communication,
// silent) when its control plane has to end it because its main thread does not return.
inline constexpr int kExitCommAtFault = 76;

// Passed as `color` to split() by ranks that join no new communicator (NCCL_SPLIT_NOCOLOR).
inline constexpr int kSplitNoColor = -1;

// Semantics common to all backends:
// - Counts are elements of `dtype`, never bytes. Every rank of the communicator calls the same
//   collectives in the same order with the same count, dtype and op; a mismatch aborts the job
//   with a message naming both calls (host backends check it on every message).
// - A call returns once the operation is ordered on `stream`. On host backends it has then
//   completed: outputs are written and inputs may be reused. Device backends complete in stream
//   order; synchronize() waits for that with the deadline and abort checks.
// - Reductions run in rank order: out = in_0 op in_1 op ... op in_{size-1}, element-wise, in the
//   element type's arithmetic (reduce.h). Host backends do exactly that, so their results are
//   bitwise reproducible and independent of the backend; NCCL does not fix its order.
// - Invalid arguments (negative count, peer out of range, sum of bools, ...) throw deltamoe::Error
//   before anything is sent and leave the communicator usable (like ncclInvalidArgument). Any other
//   failure aborts the whole job: CommAborted on every rank.
// - One thread uses a communicator at a time; the communicators of one process must be called in
//   the same order on every rank (NCCL's rule for several communicators). abort() may be called
//   from any thread.
class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // "world", or the name given to split().
  const std::string& name() const { return name_; }
  // "thread", "tcp", "mpi", ...
  virtual std::string_view backend() const = 0;

  // out[i] = in_0[i] op ... op in_{size-1}[i] for i < count. in == out is allowed.
  void all_reduce(const void* in, void* out, int64_t count, DType dtype, ReduceOp op, CommStream stream = {});
  // in holds size() blocks of count_out elements; out = the rank-ordered reduction of block rank()
  // over all ranks. out == in + rank() * count_out (in-place) is allowed.
  void reduce_scatter(const void* in, void* out, int64_t count_out, DType dtype, ReduceOp op,
                      CommStream stream = {});
  // out holds size() blocks of count_in elements; block r = rank r's in.
  // in == out + rank() * count_in (in-place) is allowed.
  void all_gather(const void* in, void* out, int64_t count_in, DType dtype, CommStream stream = {});
  // Equal counts: block j of in (count_per_peer elements at in + j * count_per_peer) goes to rank j
  // and arrives as block rank() of its out. in and out must not overlap.
  void all_to_all(const void* in, void* out, int64_t count_per_peer, DType dtype, CommStream stream = {});
  // out = root's in on every rank (in is read on root only; in == out is allowed).
  void broadcast(const void* in, void* out, int64_t count, DType dtype, int root, CommStream stream = {});

  // Point-to-point with exact counts: peer's matching recv() names the same count and dtype
  // (checked). Sends and receives between group_start() and group_end() are posted together and
  // complete at group_end(), so any pattern of them cannot deadlock (NCCL's ncclGroupStart/End).
  // Outside a group a send or recv is a group of its own. Messages between two ranks match in
  // order. Groups nest; only the outermost group_end() posts. A rank may send to itself.
  // Collectives called inside a group run at once on host backends (NCCL would fuse them).
  void group_start();
  void group_end();
  void send(const void* data, int64_t count, DType dtype, int peer, CommStream stream = {});
  void recv(void* data, int64_t count, DType dtype, int peer, CommStream stream = {});

  void barrier();

  // Collective over this communicator: ranks with the same color form a new communicator, ranked
  // by (key, rank here). color == kSplitNoColor joins none and gets nullptr. The new communicator
  // shares this one's job: aborting either aborts both.
  std::unique_ptr<Communicator> split(int color, int key, std::string name);

  // Waits until the operations ordered on `stream` have completed (deadline and abort checked).
  // Host backends: returns at once.
  virtual void synchronize(CommStream stream = {}) {}

  // A simulated world whose other ranks are copies of this one (MirrorComm, the one-GPU simulator):
  // an all-gather's other slots hold this rank's own block, not the peers' pieces, so a ZeRO rank
  // keeps the other pieces of its weights as they were rather than take those copies.
  virtual bool mirrored() const { return false; }

  // Ends the job on every rank: their current and later operations throw CommAborted with a
  // message naming this rank and `reason`. Idempotent; callable from any thread.
  virtual void abort(std::string_view reason) = 0;
  virtual bool aborted() const = 0;

  // The job's host control plane (barriers, small all-gathers, commit votes, abort), shared by the
  // world and every communicator split from it.
  virtual ControlPlane& control() = 0;

  // Labels what this rank is doing ("step 3: layer 17 dispatch") for failure messages; shared by
  // all communicators of the rank. DELTAMOE_FAULT's at:LABEL fires when the label is set.
  void set_activity(std::string label) { activity_->set_label(std::move(label)); }
  RankActivity& activity() { return *activity_; }
  // The rank's activity record, for a backend layered over this one (NcclComm, DeviceLoopbackComm)
  // so that both report into one record.
  std::shared_ptr<RankActivity> shared_activity() const { return activity_; }
  // Throws CommAborted (with the job's message) once the job is aborted.
  void throw_if_aborted() const { check_not_aborted(); }

 protected:
  Communicator(int rank, int size, std::string name, std::shared_ptr<RankActivity> activity);

  virtual void do_all_reduce(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                             CommStream stream) = 0;
  virtual void do_reduce_scatter(const void* in, void* out, int64_t count_out, DType dtype, ReduceOp op,
                                 CommStream stream) = 0;
  virtual void do_all_gather(const void* in, void* out, int64_t count_in, DType dtype, CommStream stream) = 0;
  virtual void do_all_to_all(const void* in, void* out, int64_t count_per_peer, DType dtype,
                             CommStream stream) = 0;
  virtual void do_broadcast(const void* in, void* out, int64_t count, DType dtype, int root,
                            CommStream stream) = 0;
  // Called for the outermost group only.
  virtual void do_group_start() = 0;
  virtual void do_group_end() = 0;
  virtual void do_send(const void* data, int64_t count, DType dtype, int peer, CommStream stream) = 0;
  virtual void do_recv(void* data, int64_t count, DType dtype, int peer, CommStream stream) = 0;
  virtual void do_barrier() = 0;
  virtual std::unique_ptr<Communicator> do_split(int color, int key, std::string name) = 0;

  // Throws CommAborted if the job has been aborted.
  virtual void check_not_aborted() const = 0;

  // Number of the communicator's collective operations so far (1-based after the first).
  uint64_t collective_seq() const { return collective_seq_; }

 private:
  // Bookkeeping around every operation: argument checks are done by the caller; this numbers the
  // operation, records it as the rank's activity (which may inject a fault) and ends it.
  class OpScope;
  std::string describe_op(std::string_view op, int64_t count, DType dtype, std::string_view extra) const;

  int rank_;
  int size_;
  std::string name_;
  std::shared_ptr<RankActivity> activity_;
  int group_depth_ = 0;
  int64_t group_sends_ = 0;  // posted in the open group
  int64_t group_recvs_ = 0;
  uint64_t collective_seq_ = 0;
};

}  // namespace deltamoe
