// Header descriptions and checks shared by the transports, and the control plane over exchange().
#include "parallel/host_transport.h"

#include <cstring>
#include <vector>

#include "core/error.h"
#include "parallel/communicator.h"
#include "parallel/reduce.h"

namespace deltamoe {

std::string_view message_kind_name(MessageKind kind) {
  switch (kind) {
    case MessageKind::all_reduce_scatter: return "all_reduce (reduce phase)";
    case MessageKind::all_reduce_gather: return "all_reduce (gather phase)";
    case MessageKind::reduce_scatter: return "reduce_scatter";
    case MessageKind::all_gather: return "all_gather";
    case MessageKind::all_to_all: return "all_to_all";
    case MessageKind::broadcast: return "broadcast";
    case MessageKind::barrier: return "barrier";
    case MessageKind::split: return "split";
    case MessageKind::point_to_point: return "send";
    case MessageKind::control: return "control-plane message";
  }
  return "unknown message";
}

void HostTransport::register_comm(uint64_t comm_id, std::string name) {
  std::lock_guard<std::mutex> lock(names_mutex_);
  comm_names_[comm_id] = std::move(name);
}

std::string HostTransport::comm_name(uint64_t comm_id) const {
  std::lock_guard<std::mutex> lock(names_mutex_);
  if (comm_id == kControlCommId) return "control plane";
  auto it = comm_names_.find(comm_id);
  if (it != comm_names_.end()) return str_cat("'", it->second, "'");
  return str_cat("communicator ", comm_id, " (unknown on this rank)");
}

std::string HostTransport::describe(const MessageHeader& header) const {
  const bool known_dtype = header.dtype <= static_cast<uint8_t>(DType::f64);
  const std::string dtype = known_dtype ? std::string(dtype_name(static_cast<DType>(header.dtype)))
                                        : str_cat("dtype ", int(header.dtype));
  const std::string number = header.kind == MessageKind::point_to_point
                                 ? str_cat(" (message ", header.seq, " from rank ", header.source, " to here)")
                                 : str_cat(" #", header.seq);
  return str_cat(message_kind_name(header.kind), number, " on ", comm_name(header.comm_id), " (",
                 header.count, " x ", dtype, ")");
}

std::string HostTransport::mismatch(const MessageHeader& got, const MessageHeader& want) const {
  if (got.magic != kMessageMagic) {
    return str_cat("rank ", rank_, " received a message with magic 0x", std::hex, got.magic, std::dec,
                   " from rank ", want.source, " (expected 0x", std::hex, kMessageMagic, std::dec,
                   "): a different program, protocol or byte order");
  }
  if (got.kind == want.kind && got.comm_id == want.comm_id && got.seq == want.seq &&
      got.source == want.source && got.dtype == want.dtype && got.reduce_op == want.reduce_op &&
      got.count == want.count) {
    return "";
  }
  std::string text = str_cat("rank ", rank_, " expected ", describe(want), " from rank ", want.source,
                             " but received ", describe(got));
  if (got.kind == want.kind && got.seq == want.seq && got.comm_id == want.comm_id) {
    if (got.count != want.count || got.dtype != want.dtype) {
      text += ": the two ranks passed different counts or dtypes (receives must match sends exactly)";
    } else if (got.reduce_op != want.reduce_op) {
      text += str_cat(": the ranks reduce with different ops (",
                      reduce_op_name(static_cast<ReduceOp>(got.reduce_op)), " vs ",
                      reduce_op_name(static_cast<ReduceOp>(want.reduce_op)), ")");
    }
  } else {
    text += ": the ranks called different operations (every rank of a communicator must call the same "
            "collectives in the same order, and every send needs a matching recv)";
  }
  return text;
}

void TransportControlPlane::barrier(std::string_view label) {
  all_gather("", label);
}

std::vector<std::string> TransportControlPlane::all_gather(std::string_view mine, std::string_view label) {
  const int n = transport_.size();
  const int me = transport_.rank();
  std::vector<std::string> result(n);
  result[me] = std::string(mine);
  if (n == 1) return result;
  transport_.activity()->begin_op(str_cat("control-plane all_gather '", label, "'"));
  struct EndOp {
    RankActivity& activity;
    ~EndOp() { activity.end_op(); }
  } end_op{*transport_.activity()};
  // Round 1: lengths; round 2: the bytes with those exact lengths.
  const int64_t my_length = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lengths(n, 0);
  for (int round = 0; round < 2; ++round) {
    const uint64_t seq = ++seq_;
    std::vector<SendItem> sends;
    std::vector<RecvItem> recvs;
    for (int peer = 0; peer < n; ++peer) {
      if (peer == me) continue;
      MessageHeader header;
      header.kind = MessageKind::control;
      header.dtype = static_cast<uint8_t>(round == 0 ? DType::i64 : DType::u8);
      header.comm_id = kControlCommId;
      header.seq = seq;
      header.source = me;
      header.count = round == 0 ? 1 : my_length;
      sends.push_back({peer, round == 0 ? static_cast<const void*>(&my_length) : mine.data(),
                       round == 0 ? 8 : my_length, header});
      MessageHeader expected = header;
      expected.source = peer;
      expected.count = round == 0 ? 1 : lengths[peer];
      if (round == 1) result[peer].resize(lengths[peer]);
      recvs.push_back({peer, round == 0 ? static_cast<void*>(&lengths[peer]) : result[peer].data(),
                       round == 0 ? 8 : lengths[peer], expected});
    }
    transport_.exchange(sends, recvs);
  }
  return result;
}

void TransportControlPlane::abort(std::string_view reason) {
  transport_.abort(str_cat("rank ", transport_.rank(), " aborted the job: ", reason));
}

}  // namespace deltamoe
