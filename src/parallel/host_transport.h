// The layer under the host communicators: a transport moves framed byte messages between the world
// ranks of one job (threads, TCP sockets or MPI) and carries the job's abort state. HostComm builds
// every collective from its exchange(); a new host backend only implements this interface.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>

#include "core/dtype.h"
#include "parallel/activity.h"
#include "parallel/control_plane.h"

namespace deltamoe {

// What a message belongs to; part of the header, so that ranks that called different operations
// are caught at the first message instead of exchanging garbage.
enum class MessageKind : uint8_t {
  all_reduce_scatter = 1,  // all_reduce, phase 1 (chunk to its owner)
  all_reduce_gather,       // all_reduce, phase 2 (reduced chunk to everyone)
  reduce_scatter,
  all_gather,
  all_to_all,
  broadcast,
  barrier,
  split,
  point_to_point,
  control,  // ControlPlane over the transport
};

std::string_view message_kind_name(MessageKind kind);

inline constexpr uint32_t kMessageMagic = 0x444d4d31;  // "DMM1"

// 40 bytes in front of every message, in host byte order (the magic catches a mismatch).
struct MessageHeader {
  uint32_t magic = kMessageMagic;
  MessageKind kind = MessageKind::control;
  uint8_t dtype = 0;      // DType
  uint8_t reduce_op = 0;  // ReduceOp, for reductions
  uint8_t reserved = 0;
  int32_t source = 0;  // sender's world rank
  int32_t reserved2 = 0;
  uint64_t comm_id = 0;
  uint64_t seq = 0;    // collective number on the communicator; per-pair message number for p2p
  int64_t count = 0;   // elements of dtype
};
static_assert(sizeof(MessageHeader) == 40);

struct SendItem {
  int peer;  // world rank
  const void* data;
  int64_t bytes;
  MessageHeader header;
};

struct RecvItem {
  int peer;  // world rank
  void* data;
  int64_t bytes;
  MessageHeader expected;  // the received header must equal it
};

class HostTransport {
 public:
  HostTransport(int rank, int size, std::shared_ptr<RankActivity> activity)
      : rank_(rank), size_(size), activity_(std::move(activity)) {}
  virtual ~HostTransport() = default;
  HostTransport(const HostTransport&) = delete;
  HostTransport& operator=(const HostTransport&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::shared_ptr<RankActivity>& activity() const { return activity_; }
  virtual std::string_view backend() const = 0;

  // Posts all sends and receives together and returns when every receive has arrived and matched
  // its expected header, and every send has been handed to the transport (sends are buffered:
  // the sender does not wait for the receiver). Messages between two ranks arrive in the order they
  // were sent. Peers are world ranks, never this rank. A dead peer, a deadline without progress or a
  // mismatched header aborts the job; throws CommAborted.
  virtual void exchange(std::span<const SendItem> sends, std::span<const RecvItem> recvs) = 0;

  // Ends the job on every rank with `message` (a full sentence naming the rank at fault).
  virtual void abort(std::string_view message) = 0;
  virtual bool aborted() const = 0;
  // Throws CommAborted with the job's abort message if it was aborted.
  virtual void check_not_aborted() const = 0;

  virtual ControlPlane& control() = 0;

  // Names of the communicators on this rank, for messages about a mismatched header.
  void register_comm(uint64_t comm_id, std::string name);
  std::string comm_name(uint64_t comm_id) const;

  // "all_gather #5 on 'world' (8 x f32)" for a header (communicator named when known here).
  std::string describe(const MessageHeader& header) const;
  // "" when `got` matches `want`, else a message naming both (sender `got.source`, this rank).
  std::string mismatch(const MessageHeader& got, const MessageHeader& want) const;

 private:
  const int rank_;
  const int size_;
  const std::shared_ptr<RankActivity> activity_;
  mutable std::mutex names_mutex_;
  std::map<uint64_t, std::string> comm_names_;
};

// A ControlPlane over a transport's exchange() (ThreadComm, MpiComm): the messages have kind
// `control` and communicator id 0, numbered by their own counter.
class TransportControlPlane : public ControlPlane {
 public:
  explicit TransportControlPlane(HostTransport& transport) : transport_(transport) {}
  int rank() const override { return transport_.rank(); }
  int size() const override { return transport_.size(); }
  void barrier(std::string_view label) override;
  std::vector<std::string> all_gather(std::string_view mine, std::string_view label) override;
  void abort(std::string_view reason) override;

 private:
  HostTransport& transport_;
  uint64_t seq_ = 0;
};

// Communicator id reserved for the control plane; the world communicator is 1.
inline constexpr uint64_t kControlCommId = 0;
inline constexpr uint64_t kWorldCommId = 1;

}  // namespace deltamoe
