// HostComm: the Communicator of the host backends, every collective built from one transport's
// exchange() plus rank-ordered local reductions, so ThreadComm, TcpComm and MpiComm give bitwise
// the same results. A split communicator is a HostComm over a subset of the world's ranks.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.h"
#include "parallel/host_transport.h"

namespace deltamoe {

class HostComm final : public Communicator {
 public:
  // `members` are the world ranks of this communicator in its rank order; the transport's rank must
  // be one of them. Every member constructs it with the same id.
  HostComm(std::shared_ptr<HostTransport> transport, std::vector<int> members, uint64_t comm_id,
           std::string name);

  std::string_view backend() const override { return transport_->backend(); }
  void abort(std::string_view reason) override;
  bool aborted() const override { return transport_->aborted(); }
  ControlPlane& control() override { return transport_->control(); }

  const std::vector<int>& members() const { return members_; }
  uint64_t comm_id() const { return comm_id_; }

 protected:
  void do_all_reduce(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                     CommStream stream) override;
  void do_reduce_scatter(const void* in, void* out, int64_t count_out, DType dtype, ReduceOp op,
                         CommStream stream) override;
  void do_all_gather(const void* in, void* out, int64_t count_in, DType dtype, CommStream stream) override;
  void do_all_to_all(const void* in, void* out, int64_t count_per_peer, DType dtype, CommStream stream) override;
  void do_broadcast(const void* in, void* out, int64_t count, DType dtype, int root, CommStream stream) override;
  void do_group_start() override;
  void do_group_end() override;
  void do_send(const void* data, int64_t count, DType dtype, int peer, CommStream stream) override;
  void do_recv(void* data, int64_t count, DType dtype, int peer, CommStream stream) override;
  void do_barrier() override;
  std::unique_ptr<Communicator> do_split(int color, int key, std::string name) override;
  void check_not_aborted() const override { transport_->check_not_aborted(); }

 private:
  struct PendingSend {
    int peer;
    const void* data;
    int64_t count;
    DType dtype;
  };
  struct PendingRecv {
    int peer;
    void* data;
    int64_t count;
    DType dtype;
  };

  MessageHeader header(MessageKind kind, int64_t count, DType dtype, ReduceOp op = ReduceOp::sum) const;
  SendItem send_item(int member, const void* data, int64_t count, DType dtype, const MessageHeader& header) const;
  RecvItem recv_item(int member, void* data, int64_t count, DType dtype, MessageHeader expected) const;

  std::shared_ptr<HostTransport> transport_;
  std::vector<int> members_;  // world rank of each rank of this communicator
  uint64_t comm_id_;
  std::vector<PendingSend> pending_sends_;
  std::vector<PendingRecv> pending_recvs_;
  std::vector<uint64_t> sent_to_;        // per peer: messages sent so far (p2p numbering)
  std::vector<uint64_t> received_from_;  // per peer: messages received so far
};

// Rank of `world_rank` in a split: the position of (key, parent rank) among the members of its
// color. Exposed for tests. `colors` and `keys` are indexed by parent rank.
std::vector<int> split_members(const std::vector<int>& colors, const std::vector<int>& keys, int color);

}  // namespace deltamoe
