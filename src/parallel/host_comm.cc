// HostComm's collectives over HostTransport::exchange(). Reductions are done by the owner of each
// element range, in rank order, with reduce_into (reduce.h).
#include "parallel/host_comm.h"

#include <algorithm>
#include <cstring>
#include <numeric>

namespace deltamoe {
namespace {

// Element range [begin, end) of chunk c when `count` elements are split into n nearly equal chunks
// (the first count % n chunks one element longer).
std::pair<int64_t, int64_t> chunk_range(int64_t count, int n, int c) {
  const int64_t base = count / n;
  const int64_t extra = count % n;
  const int64_t begin = c * base + std::min<int64_t>(c, extra);
  return {begin, begin + base + (c < extra ? 1 : 0)};
}

uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

}  // namespace

std::vector<int> split_members(const std::vector<int>& colors, const std::vector<int>& keys, int color) {
  std::vector<int> members;
  for (int r = 0; r < static_cast<int>(colors.size()); ++r) {
    if (colors[r] == color) members.push_back(r);
  }
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return keys[a] < keys[b]; });
  return members;
}

HostComm::HostComm(std::shared_ptr<HostTransport> transport, std::vector<int> members, uint64_t comm_id,
                   std::string name)
    : Communicator(static_cast<int>(std::find(members.begin(), members.end(), transport->rank()) - members.begin()),
                   static_cast<int>(members.size()), std::move(name), transport->activity()),
      transport_(std::move(transport)),
      members_(std::move(members)),
      comm_id_(comm_id),
      sent_to_(members_.size(), 0),
      received_from_(members_.size(), 0) {
  for (int world_rank : members_) {
    CHECK(world_rank >= 0 && world_rank < transport_->size(), "communicator '", this->name(),
          "': member ", world_rank, " is outside the world of ", transport_->size());
  }
  transport_->register_comm(comm_id_, this->name());
}

void HostComm::abort(std::string_view reason) {
  transport_->abort(str_cat("rank ", transport_->rank(), " aborted the job: ", reason));
}

MessageHeader HostComm::header(MessageKind kind, int64_t count, DType dtype, ReduceOp op) const {
  MessageHeader h;
  h.kind = kind;
  h.dtype = static_cast<uint8_t>(dtype);
  h.reduce_op = static_cast<uint8_t>(op);
  h.source = transport_->rank();
  h.comm_id = comm_id_;
  h.seq = collective_seq();
  h.count = count;
  return h;
}

SendItem HostComm::send_item(int member, const void* data, int64_t count, DType dtype,
                             const MessageHeader& h) const {
  MessageHeader out = h;
  out.count = count;
  return SendItem{members_[member], data, count * static_cast<int64_t>(dtype_size(dtype)), out};
}

RecvItem HostComm::recv_item(int member, void* data, int64_t count, DType dtype, MessageHeader expected) const {
  expected.count = count;
  expected.source = members_[member];
  return RecvItem{members_[member], data, count * static_cast<int64_t>(dtype_size(dtype)), expected};
}

void HostComm::do_all_reduce(const void* in, void* out, int64_t count, DType dtype, ReduceOp op, CommStream) {
  const int n = size();
  const int me = rank();
  const size_t element = dtype_size(dtype);
  const auto* in_bytes = static_cast<const char*>(in);
  auto* out_bytes = static_cast<char*>(out);
  // Phase 1: chunk c of every rank's input goes to rank c, which reduces it in rank order.
  const auto [my_begin, my_end] = chunk_range(count, n, me);
  const int64_t my_count = my_end - my_begin;
  std::vector<char> received(static_cast<size_t>(n) * my_count * element);
  std::vector<SendItem> sends;
  std::vector<RecvItem> recvs;
  MessageHeader h = header(MessageKind::all_reduce_scatter, 0, dtype, op);
  for (int peer = 0; peer < n; ++peer) {
    if (peer == me) continue;
    const auto [begin, end] = chunk_range(count, n, peer);
    if (end > begin) sends.push_back(send_item(peer, in_bytes + begin * element, end - begin, dtype, h));
    if (my_count > 0) {
      recvs.push_back(recv_item(peer, received.data() + peer * my_count * element, my_count, dtype, h));
    }
  }
  transport_->exchange(sends, recvs);
  std::vector<char> reduced(my_count * element);
  for (int r = 0; r < n && my_count > 0; ++r) {
    const char* part = r == me ? in_bytes + my_begin * element : received.data() + r * my_count * element;
    if (r == 0) std::memcpy(reduced.data(), part, my_count * element);
    else reduce_into(reduced.data(), part, my_count, dtype, op);
  }
  // Phase 2: every reduced chunk to every rank. The inputs were all sent in phase 1, so writing out
  // (which may be in) is safe now.
  sends.clear();
  recvs.clear();
  h = header(MessageKind::all_reduce_gather, 0, dtype, op);
  for (int peer = 0; peer < n; ++peer) {
    if (peer == me) continue;
    const auto [begin, end] = chunk_range(count, n, peer);
    if (my_count > 0) sends.push_back(send_item(peer, reduced.data(), my_count, dtype, h));
    if (end > begin) recvs.push_back(recv_item(peer, out_bytes + begin * element, end - begin, dtype, h));
  }
  transport_->exchange(sends, recvs);
  if (my_count > 0) std::memcpy(out_bytes + my_begin * element, reduced.data(), my_count * element);
}

void HostComm::do_reduce_scatter(const void* in, void* out, int64_t count_out, DType dtype, ReduceOp op,
                                 CommStream) {
  const int n = size();
  const int me = rank();
  const size_t element = dtype_size(dtype);
  const size_t block_bytes = count_out * element;
  const auto* in_bytes = static_cast<const char*>(in);
  std::vector<char> received(n * block_bytes);
  std::vector<SendItem> sends;
  std::vector<RecvItem> recvs;
  const MessageHeader h = header(MessageKind::reduce_scatter, count_out, dtype, op);
  for (int peer = 0; peer < n && count_out > 0; ++peer) {
    if (peer == me) continue;
    sends.push_back(send_item(peer, in_bytes + peer * block_bytes, count_out, dtype, h));
    recvs.push_back(recv_item(peer, received.data() + peer * block_bytes, count_out, dtype, h));
  }
  transport_->exchange(sends, recvs);
  if (count_out == 0) return;
  // Reduce into a separate buffer: out may be this rank's own input block.
  std::vector<char> reduced(block_bytes);
  for (int r = 0; r < n; ++r) {
    const char* part = r == me ? in_bytes + me * block_bytes : received.data() + r * block_bytes;
    if (r == 0) std::memcpy(reduced.data(), part, block_bytes);
    else reduce_into(reduced.data(), part, count_out, dtype, op);
  }
  std::memcpy(out, reduced.data(), block_bytes);
}

void HostComm::do_all_gather(const void* in, void* out, int64_t count_in, DType dtype, CommStream) {
  const int n = size();
  const int me = rank();
  const size_t block_bytes = count_in * dtype_size(dtype);
  auto* out_bytes = static_cast<char*>(out);
  std::vector<SendItem> sends;
  std::vector<RecvItem> recvs;
  const MessageHeader h = header(MessageKind::all_gather, count_in, dtype);
  for (int peer = 0; peer < n && count_in > 0; ++peer) {
    if (peer == me) continue;
    sends.push_back(send_item(peer, in, count_in, dtype, h));
    recvs.push_back(recv_item(peer, out_bytes + peer * block_bytes, count_in, dtype, h));
  }
  transport_->exchange(sends, recvs);
  if (block_bytes > 0 && in != out_bytes + me * block_bytes) std::memcpy(out_bytes + me * block_bytes, in, block_bytes);
}

void HostComm::do_all_to_all(const void* in, void* out, int64_t count_per_peer, DType dtype, CommStream) {
  const int n = size();
  const int me = rank();
  const size_t block_bytes = count_per_peer * dtype_size(dtype);
  const auto* in_bytes = static_cast<const char*>(in);
  auto* out_bytes = static_cast<char*>(out);
  std::vector<SendItem> sends;
  std::vector<RecvItem> recvs;
  const MessageHeader h = header(MessageKind::all_to_all, count_per_peer, dtype);
  for (int peer = 0; peer < n && count_per_peer > 0; ++peer) {
    if (peer == me) continue;
    sends.push_back(send_item(peer, in_bytes + peer * block_bytes, count_per_peer, dtype, h));
    recvs.push_back(recv_item(peer, out_bytes + peer * block_bytes, count_per_peer, dtype, h));
  }
  transport_->exchange(sends, recvs);
  if (block_bytes > 0) std::memcpy(out_bytes + me * block_bytes, in_bytes + me * block_bytes, block_bytes);
}

void HostComm::do_broadcast(const void* in, void* out, int64_t count, DType dtype, int root, CommStream) {
  const int n = size();
  const int me = rank();
  std::vector<SendItem> sends;
  std::vector<RecvItem> recvs;
  const MessageHeader h = header(MessageKind::broadcast, count, dtype);
  if (count > 0) {
    if (me == root) {
      for (int peer = 0; peer < n; ++peer) {
        if (peer != me) sends.push_back(send_item(peer, in, count, dtype, h));
      }
    } else {
      recvs.push_back(recv_item(root, out, count, dtype, h));
    }
  }
  transport_->exchange(sends, recvs);
  if (me == root && count > 0 && in != out) std::memcpy(out, in, count * dtype_size(dtype));
}

void HostComm::do_group_start() {
  pending_sends_.clear();
  pending_recvs_.clear();
}

void HostComm::do_send(const void* data, int64_t count, DType dtype, int peer, CommStream) {
  pending_sends_.push_back({peer, data, count, dtype});
}

void HostComm::do_recv(void* data, int64_t count, DType dtype, int peer, CommStream) {
  pending_recvs_.push_back({peer, data, count, dtype});
}

void HostComm::do_group_end() {
  const int me = rank();
  std::vector<PendingSend> sends = std::move(pending_sends_);
  std::vector<PendingRecv> recvs = std::move(pending_recvs_);
  pending_sends_.clear();
  pending_recvs_.clear();
  // Messages to itself are copied here, matched in order like any other pair.
  std::vector<const PendingSend*> self_sends;
  std::vector<SendItem> send_items;
  for (const PendingSend& s : sends) {
    if (s.peer == me) {
      self_sends.push_back(&s);
      continue;
    }
    MessageHeader h = header(MessageKind::point_to_point, s.count, s.dtype);
    h.seq = ++sent_to_[s.peer];
    send_items.push_back(send_item(s.peer, s.data, s.count, s.dtype, h));
  }
  std::vector<RecvItem> recv_items;
  size_t next_self = 0;
  for (const PendingRecv& r : recvs) {
    if (r.peer == me) {
      CHECK(next_self < self_sends.size(), "recv from itself on '", name(), "' (rank ", me,
            ") has no matching send to itself in the same group");
      const PendingSend& s = *self_sends[next_self++];
      CHECK(s.count == r.count && s.dtype == r.dtype, "rank ", me, " on '", name(), "': a send to itself of ",
            s.count, " x ", dtype_name(s.dtype), " meets a recv of ", r.count, " x ", dtype_name(r.dtype),
            " (receives must match sends exactly)");
      if (r.count > 0 && r.data != s.data) std::memmove(r.data, s.data, r.count * dtype_size(r.dtype));
      continue;
    }
    MessageHeader h = header(MessageKind::point_to_point, r.count, r.dtype);
    h.seq = ++received_from_[r.peer];
    recv_items.push_back(recv_item(r.peer, r.data, r.count, r.dtype, h));
  }
  CHECK(next_self == self_sends.size(), "rank ", me, " on '", name(), "': ", self_sends.size() - next_self,
        " send(s) to itself without a matching recv in the same group");
  transport_->exchange(send_items, recv_items);
}

void HostComm::do_barrier() {
  const int n = size();
  const int me = rank();
  std::vector<SendItem> sends;
  std::vector<RecvItem> recvs;
  const MessageHeader h = header(MessageKind::barrier, 0, DType::u8);
  for (int peer = 0; peer < n; ++peer) {
    if (peer == me) continue;
    sends.push_back(send_item(peer, nullptr, 0, DType::u8, h));
    recvs.push_back(recv_item(peer, nullptr, 0, DType::u8, h));
  }
  transport_->exchange(sends, recvs);
}

std::unique_ptr<Communicator> HostComm::do_split(int color, int key, std::string name) {
  const int n = size();
  const int me = rank();
  const int32_t mine[2] = {color, key};
  std::vector<int32_t> all(2 * n);
  std::vector<SendItem> sends;
  std::vector<RecvItem> recvs;
  const MessageHeader h = header(MessageKind::split, 2, DType::i32);
  for (int peer = 0; peer < n; ++peer) {
    if (peer == me) continue;
    sends.push_back(send_item(peer, mine, 2, DType::i32, h));
    recvs.push_back(recv_item(peer, all.data() + 2 * peer, 2, DType::i32, h));
  }
  transport_->exchange(sends, recvs);
  all[2 * me] = color;
  all[2 * me + 1] = key;
  if (color == kSplitNoColor) return nullptr;
  std::vector<int> colors(n), keys(n);
  for (int r = 0; r < n; ++r) {
    colors[r] = all[2 * r];
    keys[r] = all[2 * r + 1];
  }
  std::vector<int> world_members;
  for (int r : split_members(colors, keys, color)) world_members.push_back(members_[r]);
  // The same on every member: derived from this communicator, this split's number and the color.
  const uint64_t id = mix64(comm_id_ ^ mix64(collective_seq() * 0x9e3779b97f4a7c15ULL + color + 1)) | 2;
  return std::make_unique<HostComm>(transport_, std::move(world_members), id, std::move(name));
}

}  // namespace deltamoe
