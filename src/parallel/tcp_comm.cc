// TcpComm: the data connections between every pair of ranks and the exchange() that drives them
// with one poll loop (so any pattern of sends and receives progresses without deadlock), plus the
// job setup: data listener, rendezvous, connection mesh, control plane.
#include "parallel/tcp_comm.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>

#include "core/log.h"
#include "parallel/host_comm.h"
#include "parallel/host_transport.h"
#include "parallel/rendezvous.h"
#include "parallel/tcp_control_plane.h"

namespace deltamoe {
namespace {

inline constexpr uint32_t kDataMagic = 0x444d4454;  // "DMDT"
inline constexpr size_t kMaxChunk = 8u << 20;      // bytes per send()/recv() call

uint64_t run_hash(const std::string& run_id) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : run_id) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", seconds);
  return text;
}

std::string list_ranks(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) text += str_cat(i ? ", " : "", ranks[i]);
  return text;
}

class TcpTransport final : public HostTransport {
 public:
  TcpTransport(int rank, std::shared_ptr<RankActivity> activity, std::vector<Socket> peers,
               std::unique_ptr<TcpControlPlane> control)
      : HostTransport(rank, static_cast<int>(peers.size()), std::move(activity)),
        peers_(std::move(peers)),
        control_(std::move(control)) {}

  std::string_view backend() const override { return "tcp"; }
  void abort(std::string_view message) override { control_->abort(message); }
  bool aborted() const override { return control_->aborted(); }
  void check_not_aborted() const override {
    if (control_->aborted()) throw CommAborted(control_->abort_message());
  }
  ControlPlane& control() override { return *control_; }

  void exchange(std::span<const SendItem> sends, std::span<const RecvItem> recvs) override;

 private:
  struct Out {
    const SendItem* item;
    size_t offset = 0;  // over header + data
  };
  struct In {
    const RecvItem* item;
    MessageHeader header{};
    size_t offset = 0;
  };

  // Member order matters: the control plane says goodbye before the data sockets close.
  std::vector<Socket> peers_;
  std::unique_ptr<TcpControlPlane> control_;
};

void TcpTransport::exchange(std::span<const SendItem> sends, std::span<const RecvItem> recvs) {
  check_not_aborted();
  const int n = size();
  std::vector<std::deque<Out>> outs(n);
  std::vector<std::deque<In>> ins(n);
  for (const SendItem& s : sends) outs[s.peer].push_back(Out{&s});
  for (const RecvItem& r : recvs) ins[r.peer].push_back(In{&r});
  size_t pending = sends.size() + recvs.size();
  std::vector<bool> lost(n, false);
  auto last_progress = SteadyClock::now();
  bool reported = false;
  auto reported_at = SteadyClock::now();
  std::string report;
  const double timeout = control_->options().timeout_seconds;
  const double grace = control_->options().abort_grace();

  auto fail_locally = [&](const std::string& message) {
    control_->abort(message);
    throw CommAborted(control_->abort_message());
  };
  auto report_once = [&](const std::string& message, const std::vector<int>& blamed, bool stall) {
    if (reported) return;
    reported = true;
    reported_at = SteadyClock::now();
    report = message;
    control_->report_problem(message, blamed, stall);
  };
  auto peer_lost = [&](int peer, const std::string& reason) {
    lost[peer] = true;
    report_once(str_cat("rank ", rank(), " lost its data connection to rank ", peer, " (", reason, ") while ",
                        activity()->describe()),
                {peer}, false);
  };

  while (pending > 0) {
    std::vector<pollfd> fds{{control_->abort_fd(), POLLIN, 0}};
    std::vector<int> fd_peer{-1};
    for (int p = 0; p < n; ++p) {
      if (lost[p] || (outs[p].empty() && ins[p].empty())) continue;
      short events = 0;
      if (!outs[p].empty()) events |= POLLOUT;
      if (!ins[p].empty()) events |= POLLIN;
      fds.push_back({peers_[p].fd(), events, 0});
      fd_peer.push_back(p);
    }
    ::poll(fds.data(), fds.size(), 100);
    check_not_aborted();
    bool progressed = false;
    for (size_t i = 1; i < fds.size(); ++i) {
      const int p = fd_peer[i];
      const short revents = fds[i].revents;
      if (revents == 0) continue;
      const int fd = fds[i].fd;
      // Receive: header first (checked against the expected one), then the payload.
      while (!lost[p] && !ins[p].empty() && (revents & (POLLIN | POLLHUP | POLLERR))) {
        In& in = ins[p].front();
        const size_t header_bytes = sizeof(MessageHeader);
        const size_t total = header_bytes + in.item->bytes;
        char* target = in.offset < header_bytes ? reinterpret_cast<char*>(&in.header) + in.offset
                                                 : static_cast<char*>(in.item->data) + (in.offset - header_bytes);
        const size_t want = in.offset < header_bytes ? header_bytes - in.offset
                                                     : std::min(total - in.offset, kMaxChunk);
        const ssize_t got = ::recv(fd, target, want, 0);
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
        if (got <= 0) {
          peer_lost(p, got == 0 ? "closed by the peer" : std::strerror(errno));
          break;
        }
        in.offset += got;
        progressed = true;
        if (in.offset == header_bytes && in.offset - got < header_bytes) {  // header just completed
          const std::string problem = mismatch(in.header, in.item->expected);
          if (!problem.empty()) fail_locally(problem);
        }
        if (in.offset == total) {
          ins[p].pop_front();
          --pending;
        }
      }
      // Send: header, then payload.
      while (!lost[p] && !outs[p].empty() && (revents & (POLLOUT | POLLHUP | POLLERR))) {
        Out& out = outs[p].front();
        const size_t header_bytes = sizeof(MessageHeader);
        const size_t total = header_bytes + out.item->bytes;
        const char* source = out.offset < header_bytes
                                 ? reinterpret_cast<const char*>(&out.item->header) + out.offset
                                 : static_cast<const char*>(out.item->data) + (out.offset - header_bytes);
        const size_t want = out.offset < header_bytes ? header_bytes - out.offset
                                                      : std::min(total - out.offset, kMaxChunk);
        const ssize_t put = ::send(fd, source, want, MSG_NOSIGNAL);
        if (put < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
        if (put <= 0) {
          peer_lost(p, std::strerror(errno));
          break;
        }
        out.offset += put;
        progressed = true;
        if (out.offset == total) {
          outs[p].pop_front();
          --pending;
        }
      }
    }
    if (progressed) last_progress = SteadyClock::now();
    const double idle = std::chrono::duration<double>(SteadyClock::now() - last_progress).count();
    if (!reported && idle > timeout) {
      std::vector<int> waiting_for;
      for (int p = 0; p < n; ++p) {
        if (!ins[p].empty() || !outs[p].empty()) waiting_for.push_back(p);
      }
      report_once(str_cat("rank ", rank(), " waited ", seconds_text(idle), " for rank(s) ", list_ranks(waiting_for),
                          " with no data moving, while ", activity()->describe()),
                  waiting_for, true);
    }
    // Rank 0 normally answers a report with the job's abort at once; if it does not (it is gone
    // too), give up alone.
    if (reported && std::chrono::duration<double>(SteadyClock::now() - reported_at).count() > grace) {
      fail_locally(report);
    }
  }
}

struct DataHello {
  uint32_t magic;
  int32_t rank;
  uint64_t run;
};

std::vector<Socket> connect_mesh(int rank, const std::vector<RankInfo>& table, Socket listener,
                                 const std::string& run_id, double timeout) {
  const int n = static_cast<int>(table.size());
  std::vector<Socket> peers(n);
  const Deadline deadline = deadline_after(timeout);
  const DataHello mine{kDataMagic, rank, run_hash(run_id)};
  for (int p = 0; p < rank; ++p) {
    std::string error;
    Socket s = connect_tcp(table[p].address, table[p].data_port, deadline, &error);
    CHECK(s.valid(), "rank ", rank, " could not open its data connection to rank ", p, " at ", table[p].address, ":",
          table[p].data_port, " (", table[p].host, "): ", error);
    error = write_all(s.fd(), &mine, sizeof(mine), deadline);
    CHECK(error.empty(), "rank ", rank, ": data connection to rank ", p, " failed: ", error);
    peers[p] = std::move(s);
  }
  int missing = n - 1 - rank;
  while (missing > 0) {
    Socket s = accept_tcp(listener.fd(), deadline);
    if (!s.valid()) {
      std::vector<int> absent;
      for (int p = rank + 1; p < n; ++p) {
        if (!peers[p].valid()) absent.push_back(p);
      }
      RAISE("rank ", rank, ": ranks ", list_ranks(absent), " did not open their data connections within ",
            seconds_text(timeout), " (a firewall between the hosts?)");
    }
    DataHello hello{};
    const std::string error = read_exact(s.fd(), &hello, sizeof(hello), deadline_after(10));
    if (!error.empty() || hello.magic != kDataMagic || hello.run != mine.run || hello.rank <= rank ||
        hello.rank >= n || peers[hello.rank].valid()) {
      log_debug("tcp: rank ", rank, " dropped a data connection from ", peer_address(s.fd()), " that is not one of "
                "this job's ranks");
      continue;
    }
    peers[hello.rank] = std::move(s);
    --missing;
  }
  return peers;
}

}  // namespace

std::unique_ptr<Communicator> connect_tcp_comm(const LaunchEnv& env, const CommOptions& options) {
  std::string error;
  Socket listener = listen_tcp(0, &error);
  CHECK(listener.valid(), "rank ", env.rank, ": cannot open a data listener: ", error);
  RendezvousConfig config;
  config.rank = env.rank;
  config.world_size = env.world_size;
  config.local_rank = env.local_rank;
  config.master_addr = env.master_addr;
  config.port = env.rendezvous_port;
  config.run_id = env.run_id;
  config.listener_fd = env.rank == 0 ? env.rendezvous_fd : -1;
  config.timeout_seconds = options.rendezvous_timeout_seconds;
  config.data_port = local_port(listener.fd());
  config.origin = env.rendezvous_origin.empty() ? str_cat(launcher_name(env.launcher), " variables")
                                                : env.rendezvous_origin;
  RendezvousResult rendezvous_result = rendezvous(config);
  std::vector<Socket> peers = connect_mesh(env.rank, rendezvous_result.table, std::move(listener), env.run_id,
                                           options.rendezvous_timeout_seconds);
  auto activity = std::make_shared<RankActivity>(env.rank);
  if (options.fault) activity->arm_fault(*options.fault);
  const RankInfo me = rendezvous_result.table[env.rank];
  auto control = std::make_unique<TcpControlPlane>(std::move(rendezvous_result), env.rank, activity, options);
  auto transport = std::make_shared<TcpTransport>(env.rank, activity, std::move(peers), std::move(control));
  std::vector<int> members(env.world_size);
  for (int r = 0; r < env.world_size; ++r) members[r] = r;
  log_info("rank ", env.rank, " of ", env.world_size, " (local ", env.local_rank, ") on ", me.host, ", pid ", me.pid,
           ": TcpComm ready (", launcher_name(env.launcher), ", rendezvous ", env.master_addr, ":",
           env.rendezvous_port, ")");
  return std::make_unique<HostComm>(std::move(transport), std::move(members), kWorldCommId, "world");
}

}  // namespace deltamoe
