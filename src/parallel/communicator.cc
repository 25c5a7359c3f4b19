// Communicator's public calls: argument checks shared by all backends, operation numbering and the
// rank's activity record around each backend call, and group nesting.
#include "parallel/communicator.h"

#include <algorithm>

namespace deltamoe {

class Communicator::OpScope {
 public:
  OpScope(Communicator& comm, std::string description) : comm_(comm) {
    comm_.check_not_aborted();
    comm_.activity_->begin_op(std::move(description));
  }
  ~OpScope() { comm_.activity_->end_op(); }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  Communicator& comm_;
};

Communicator::Communicator(int rank, int size, std::string name, std::shared_ptr<RankActivity> activity)
    : rank_(rank), size_(size), name_(std::move(name)), activity_(std::move(activity)) {
  CHECK(size_ >= 1 && rank_ >= 0 && rank_ < size_, "communicator '", name_, "': rank ", rank_,
        " is outside a world of ", size_);
  CHECK(activity_ != nullptr, "communicator '", name_, "' has no activity record");
}

std::string Communicator::describe_op(std::string_view op, int64_t count, DType dtype,
                                      std::string_view extra) const {
  return str_cat(op, " #", collective_seq_, " on '", name_, "' (", count, " x ", dtype_name(dtype),
                 extra.empty() ? "" : ", ", extra, ")");
}

namespace {

void check_count(std::string_view op, const std::string& comm, int64_t count, const void* buffer,
                 std::string_view buffer_name) {
  CHECK(count >= 0, op, " on '", comm, "': count ", count, " is negative");
  CHECK(count == 0 || buffer != nullptr, op, " on '", comm, "': ", buffer_name, " is null for ", count,
        " elements");
}

void check_reduction(std::string_view op, const std::string& comm, DType dtype, ReduceOp reduce) {
  CHECK(reduce_supported(dtype, reduce), op, " on '", comm, "': reduction '", reduce_op_name(reduce),
        "' is not defined for ", dtype_name(dtype), " elements (u8 and bool support max only)");
}

bool overlap(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const char* pa = static_cast<const char*>(a);
  const char* pb = static_cast<const char*>(b);
  return a_bytes > 0 && b_bytes > 0 && pa < pb + b_bytes && pb < pa + a_bytes;
}

}  // namespace

void Communicator::all_reduce(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                              CommStream stream) {
  check_count("all_reduce", name_, count, in, "input");
  check_count("all_reduce", name_, count, out, "output");
  check_reduction("all_reduce", name_, dtype, op);
  ++collective_seq_;
  OpScope scope(*this, describe_op("all_reduce", count, dtype, reduce_op_name(op)));
  do_all_reduce(in, out, count, dtype, op, stream);
}

void Communicator::reduce_scatter(const void* in, void* out, int64_t count_out, DType dtype, ReduceOp op,
                                  CommStream stream) {
  check_count("reduce_scatter", name_, count_out, in, "input");
  check_count("reduce_scatter", name_, count_out, out, "output");
  check_reduction("reduce_scatter", name_, dtype, op);
  const int64_t element = static_cast<int64_t>(dtype_size(dtype));
  const char* own_block = static_cast<const char*>(in) + rank_ * count_out * element;
  CHECK(out == own_block || !overlap(in, size_ * count_out * element, out, count_out * element),
        "reduce_scatter on '", name_, "': output overlaps the input other than as its own block "
        "(in + rank * count_out)");
  ++collective_seq_;
  OpScope scope(*this, describe_op("reduce_scatter", count_out, dtype, reduce_op_name(op)));
  do_reduce_scatter(in, out, count_out, dtype, op, stream);
}

void Communicator::all_gather(const void* in, void* out, int64_t count_in, DType dtype, CommStream stream) {
  check_count("all_gather", name_, count_in, in, "input");
  check_count("all_gather", name_, count_in, out, "output");
  const int64_t element = static_cast<int64_t>(dtype_size(dtype));
  const char* own_block = static_cast<const char*>(out) + rank_ * count_in * element;
  CHECK(in == own_block || !overlap(in, count_in * element, out, size_ * count_in * element),
        "all_gather on '", name_, "': input overlaps the output other than as its own block "
        "(out + rank * count_in)");
  ++collective_seq_;
  OpScope scope(*this, describe_op("all_gather", count_in, dtype, ""));
  do_all_gather(in, out, count_in, dtype, stream);
}

void Communicator::all_to_all(const void* in, void* out, int64_t count_per_peer, DType dtype,
                              CommStream stream) {
  check_count("all_to_all", name_, count_per_peer, in, "input");
  check_count("all_to_all", name_, count_per_peer, out, "output");
  const int64_t bytes = size_ * count_per_peer * static_cast<int64_t>(dtype_size(dtype));
  CHECK(!overlap(in, bytes, out, bytes), "all_to_all on '", name_, "': input and output overlap");
  ++collective_seq_;
  OpScope scope(*this, describe_op("all_to_all", count_per_peer, dtype, ""));
  do_all_to_all(in, out, count_per_peer, dtype, stream);
}

void Communicator::broadcast(const void* in, void* out, int64_t count, DType dtype, int root,
                             CommStream stream) {
  CHECK(root >= 0 && root < size_, "broadcast on '", name_, "': root ", root, " is outside ranks 0..",
        size_ - 1);
  if (rank_ == root) check_count("broadcast", name_, count, in, "input");
  check_count("broadcast", name_, count, out, "output");
  ++collective_seq_;
  OpScope scope(*this, describe_op("broadcast", count, dtype, str_cat("root ", root)));
  do_broadcast(in, out, count, dtype, root, stream);
}

void Communicator::group_start() {
  if (group_depth_++ == 0) {
    group_sends_ = 0;
    group_recvs_ = 0;
    do_group_start();
  }
}

void Communicator::group_end() {
  CHECK(group_depth_ > 0, "group_end on '", name_, "' without a matching group_start");
  if (--group_depth_ > 0) return;
  OpScope scope(*this, str_cat("send/recv group on '", name_, "' (", group_sends_, " sends, ", group_recvs_,
                               " receives)"));
  do_group_end();
}

void Communicator::send(const void* data, int64_t count, DType dtype, int peer, CommStream stream) {
  check_count("send", name_, count, data, "buffer");
  CHECK(peer >= 0 && peer < size_, "send on '", name_, "': peer ", peer, " is outside ranks 0..", size_ - 1);
  if (group_depth_ == 0) {
    group_start();
    do_send(data, count, dtype, peer, stream);
    ++group_sends_;
    group_end();
    return;
  }
  do_send(data, count, dtype, peer, stream);
  ++group_sends_;
}

void Communicator::recv(void* data, int64_t count, DType dtype, int peer, CommStream stream) {
  check_count("recv", name_, count, data, "buffer");
  CHECK(peer >= 0 && peer < size_, "recv on '", name_, "': peer ", peer, " is outside ranks 0..", size_ - 1);
  if (group_depth_ == 0) {
    group_start();
    do_recv(data, count, dtype, peer, stream);
    ++group_recvs_;
    group_end();
    return;
  }
  do_recv(data, count, dtype, peer, stream);
  ++group_recvs_;
}

void Communicator::barrier() {
  ++collective_seq_;
  OpScope scope(*this, str_cat("barrier #", collective_seq_, " on '", name_, "'"));
  do_barrier();
}

std::unique_ptr<Communicator> Communicator::split(int color, int key, std::string name) {
  CHECK(color >= 0 || color == kSplitNoColor, "split of '", name_, "': color ", color,
        " is negative (use kSplitNoColor to join no communicator)");
  ++collective_seq_;
  OpScope scope(*this, str_cat("split #", collective_seq_, " of '", name_, "' into '", name, "' (color ",
                               color, ", key ", key, ")"));
  return do_split(color, key, std::move(name));
}

}  // namespace deltamoe
