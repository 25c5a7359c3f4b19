// Both sides of the rendezvous. Rank 0 polls its listener and the connections that have not yet
// said hello, so a slow or foreign client cannot hold up the others.
#include "parallel/rendezvous.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <optional>

#include "core/error.h"
#include "core/log.h"

namespace deltamoe {
namespace {

struct Hello {
  uint32_t magic = 0;
  uint32_t version = 0;
  std::string build;
  std::string run_id;
  int rank = -1;
  int world = 0;
  int local_rank = 0;
  std::string host;
  int pid = 0;
  int data_port = 0;
};

std::string build_id() { return str_cat("deltamoe ", DELTAMOE_VERSION); }

std::string encode_hello(const RendezvousConfig& config) {
  WireWriter w;
  w.u32(kRendezvousMagic).u32(kProtocolVersion).str(build_id()).str(config.run_id);
  w.i32(config.rank).i32(config.world_size).i32(config.local_rank).str(this_host_name());
  w.i32(static_cast<int32_t>(::getpid())).i32(config.data_port);
  return w.bytes();
}

Hello decode_hello(const std::string& payload, const std::string& from) {
  WireReader r(payload, str_cat("hello from ", from));
  Hello h;
  h.magic = r.u32();
  if (h.magic != kRendezvousMagic) return h;
  h.version = r.u32();
  if (h.version != kProtocolVersion) return h;
  h.build = r.str();
  h.run_id = r.str();
  h.rank = r.i32();
  h.world = r.i32();
  h.local_rank = r.i32();
  h.host = r.str();
  h.pid = r.i32();
  h.data_port = r.i32();
  return h;
}

std::string describe_process(const Hello& h, const std::string& address) {
  return str_cat("pid ", h.pid, " on ", h.host, " (", address, ")");
}

std::string list_ranks(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) text += str_cat(i ? ", " : "", ranks[i]);
  return text;
}

// Rank 0's side.
RendezvousResult serve(const RendezvousConfig& config) {
  std::string error;
  Socket listener;
  if (config.listener_fd >= 0) {
    listener = Socket(config.listener_fd);
    int listening = 0;
    socklen_t length = sizeof(listening);
    const bool usable = ::getsockopt(listener.fd(), SOL_SOCKET, SO_ACCEPTCONN, &listening, &length) == 0 &&
                        listening && local_port(listener.fd()) == config.port;
    if (!usable) {
      log_warn("rendezvous: the inherited socket (DELTAMOE_RDZV_FD=", config.listener_fd, ") is not listening on port ",
               config.port, "; binding the port instead");
      listener.release();  // not ours to close
      listener = Socket();
    } else {
      ::fcntl(listener.fd(), F_SETFD, FD_CLOEXEC);  // not passed on to programs this rank starts
      set_nonblocking(listener.fd());
    }
  }
  if (!listener.valid()) listener = listen_tcp(config.port, &error);
  CHECK(listener.valid(), "rank 0 cannot listen on port ", config.port, " for the rendezvous (", config.origin,
        "): ", error, ". Another job, or torchrun's agent store, may hold it: choose another MASTER_PORT or set "
        "DELTAMOE_RDZV_PORT");
  const Deadline deadline = deadline_after(config.timeout_seconds);
  struct Pending {
    Socket socket;
    FrameReader reader;
    Deadline hello_deadline;
    std::string address;
  };
  std::vector<Pending> pending;
  std::vector<Socket> arrived(config.world_size);
  std::vector<Hello> hellos(config.world_size);
  std::vector<std::string> addresses(config.world_size);
  int num_arrived = 1;
  std::string fatal;

  auto refuse_all = [&](const std::string& reason) {
    WireWriter w;
    w.str(reason);
    for (Socket& s : arrived) {
      if (s.valid()) write_frame(s.fd(), kFrameRefuse, w.bytes(), deadline_after(1));
    }
    for (Pending& p : pending) write_frame(p.socket.fd(), kFrameRefuse, w.bytes(), deadline_after(1));
  };

  while (num_arrived < config.world_size && fatal.empty()) {
    if (seconds_until(deadline) <= 0) {
      std::vector<int> missing;
      for (int r = 1; r < config.world_size; ++r) {
        if (!arrived[r].valid()) missing.push_back(r);
      }
      const std::string message = str_cat(
          "rendezvous on port ", config.port, " (", config.origin, ") timed out after ", config.timeout_seconds,
          " s: got ", num_arrived, " of ", config.world_size, " ranks; ranks ", list_ranks(missing),
          " never came. Was the program started with srun / torchrun / deltamoe launch on every node, with the "
          "same MASTER_ADDR and port? (DELTAMOE_RDZV_TIMEOUT sets the wait)");
      refuse_all(message);
      RAISE(message);
    }
    std::vector<pollfd> fds{{listener.fd(), POLLIN, 0}};
    for (Pending& p : pending) fds.push_back({p.socket.fd(), POLLIN, 0});
    ::poll(fds.data(), fds.size(), 100);
    if (fds[0].revents & POLLIN) {
      Socket s = accept_tcp(listener.fd(), deadline_after(0));
      if (s.valid()) {
        const std::string address = peer_address(s.fd());
        pending.push_back({std::move(s), FrameReader(), deadline_after(10), address});
      }
    }
    for (size_t i = 0; i < pending.size() && fatal.empty();) {
      Pending& p = pending[i];
      std::optional<Frame> frame;
      std::string problem;
      try {
        problem = p.reader.read_available(p.socket.fd());
        frame = p.reader.next();
      } catch (const Error& e) {
        problem = e.what();
      }
      if (!frame) {
        if (!problem.empty() || seconds_until(p.hello_deadline) <= 0) {
          log_debug("rendezvous: dropped a connection from ", p.address, " without a hello (",
                    problem.empty() ? "no hello within 10 s" : problem, ")");
          pending.erase(pending.begin() + i);
          continue;
        }
        ++i;
        continue;
      }
      Hello h;
      try {
        h = decode_hello(frame->payload, p.address);
      } catch (const Error&) {
        h.magic = 0;
      }
      if (frame->type != kFrameHello || h.magic != kRendezvousMagic) {
        log_debug("rendezvous: dropped a connection from ", p.address, " that is not a deltamoe rank");
        pending.erase(pending.begin() + i);
        continue;
      }
      const std::string who = describe_process(h, p.address);
      if (h.version != kProtocolVersion) {
        fatal = str_cat("a process at ", p.address, " speaks rendezvous protocol ", h.version, ", rank 0 speaks ",
                        kProtocolVersion, ": every rank must run the same deltamoe build");
      } else if (h.build != build_id()) {
        fatal = str_cat("rank ", h.rank, " (", who, ") runs '", h.build, "', rank 0 runs '", build_id(),
                        "': every rank must run the same deltamoe build");
      } else if (h.world != config.world_size) {
        fatal = str_cat("rank ", h.rank, " (", who, ") was started for a world of ", h.world,
                        " ranks, rank 0 for ", config.world_size, ": the launch variables differ between ranks");
      } else if (h.run_id != config.run_id) {
        fatal = str_cat("rank ", h.rank, " (", who, ") belongs to run '", h.run_id, "', rank 0 to run '",
                        config.run_id, "': two jobs share the rendezvous address ", config.master_addr, ":",
                        config.port, " (choose another MASTER_PORT)");
      } else if (h.rank == 0) {
        fatal = str_cat("two processes are rank 0: this one (pid ", ::getpid(), " on ", this_host_name(), ") and ",
                        who, ": the launch variables are wrong");
      } else if (h.rank < 0 || h.rank >= config.world_size) {
        fatal = str_cat("a process (", who, ") says it is rank ", h.rank, " of a world of ", config.world_size);
      } else if (arrived[h.rank].valid()) {
        fatal = str_cat("rank ", h.rank, " came twice: ", describe_process(hellos[h.rank], addresses[h.rank]),
                        " and ", who, ": the launch variables give two processes the same rank");
      }
      if (!fatal.empty()) {
        arrived.push_back(std::move(p.socket));  // refused below with the others
        pending.erase(pending.begin() + i);
        break;
      }
      hellos[h.rank] = h;
      addresses[h.rank] = p.address;
      arrived[h.rank] = std::move(p.socket);
      ++num_arrived;
      pending.erase(pending.begin() + i);
    }
  }
  if (!fatal.empty()) {
    refuse_all(fatal);
    RAISE("rendezvous failed: ", fatal);
  }
  RendezvousResult result;
  result.table.resize(config.world_size);
  result.table[0] = RankInfo{0, config.local_rank, static_cast<int>(::getpid()), this_host_name(), "", config.data_port};
  for (int r = 1; r < config.world_size; ++r) {
    result.table[r] = RankInfo{r, hellos[r].local_rank, hellos[r].pid, hellos[r].host, addresses[r], hellos[r].data_port};
  }
  WireWriter w;
  w.i32(config.world_size);
  for (const RankInfo& info : result.table) {
    w.i32(info.local_rank).i32(info.pid).str(info.host).str(info.address).i32(info.data_port);
  }
  for (int r = 1; r < config.world_size; ++r) {
    const std::string problem = write_frame(arrived[r].fd(), kFrameWelcome, w.bytes(), deadline_after(config.timeout_seconds));
    CHECK(problem.empty(), "rendezvous: sending the rank table to rank ", r, " (",
          describe_process(hellos[r], addresses[r]), ") failed: ", problem);
  }
  result.control = std::move(arrived);
  result.control.resize(config.world_size);
  return result;
}

// A worker's side.
RendezvousResult join(const RendezvousConfig& config) {
  const Deadline deadline = deadline_after(config.timeout_seconds);
  std::string error;
  Socket socket = connect_tcp(config.master_addr, config.port, deadline, &error);
  CHECK(socket.valid(), "rank ", config.rank, " could not reach rank 0's rendezvous at ", config.master_addr, ":",
        config.port, " (", config.origin, ") within ", config.timeout_seconds, " s: ", error,
        ". Is rank 0 running, with the same MASTER_ADDR and port on every rank? (DELTAMOE_RDZV_TIMEOUT sets the wait)");
  std::string problem = write_frame(socket.fd(), kFrameHello, encode_hello(config), deadline);
  CHECK(problem.empty(), "rank ", config.rank, ": sending hello to rank 0 at ", config.master_addr, ":", config.port,
        " failed: ", problem);
  // Rank 0 answers when all ranks are in, or refuses (with the missing ranks) at its own deadline;
  // wait a little longer than it does so its reason arrives.
  std::optional<Frame> frame = read_frame(socket.fd(), deadline_after(config.timeout_seconds + 10), &problem);
  CHECK(frame.has_value(), "rank ", config.rank, ": no rank table from rank 0 at ", config.master_addr, ":",
        config.port, " (", problem, ")");
  if (frame->type == kFrameRefuse) {
    WireReader r(frame->payload, "refusal from rank 0");
    RAISE("rank 0 ended the rendezvous: ", r.str());
  }
  CHECK(frame->type == kFrameWelcome, "rank ", config.rank, ": rank 0 at ", config.master_addr, ":", config.port,
        " answered with message type ", frame->type, " instead of the rank table (not a deltamoe rank 0?)");
  WireReader r(frame->payload, "rank table from rank 0");
  const int world = r.i32();
  CHECK(world == config.world_size, "rank table for a world of ", world, ", expected ", config.world_size);
  RendezvousResult result;
  for (int rank = 0; rank < world; ++rank) {
    RankInfo info;
    info.rank = rank;
    info.local_rank = r.i32();
    info.pid = r.i32();
    info.host = r.str();
    info.address = r.str();
    info.data_port = r.i32();
    if (rank == 0) info.address = config.master_addr;
    result.table.push_back(info);
  }
  result.control.resize(world);
  result.control[0] = std::move(socket);
  return result;
}

}  // namespace

std::string this_host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

RendezvousResult rendezvous(const RendezvousConfig& config) {
  CHECK(config.world_size >= 1 && config.rank >= 0 && config.rank < config.world_size, "rendezvous: rank ",
        config.rank, " of ", config.world_size);
  if (config.world_size == 1) {
    RendezvousResult result;
    result.table.push_back(RankInfo{0, config.local_rank, static_cast<int>(::getpid()), this_host_name(), "", config.data_port});
    result.control.resize(1);
    return result;
  }
  CHECK(!config.master_addr.empty() && config.port > 0, "rank ", config.rank, " of ", config.world_size,
        " has no rendezvous address: set MASTER_ADDR and MASTER_PORT (mpirun: -x MASTER_ADDR=<host of rank 0> "
        "-x MASTER_PORT=<port>) or build with MPI");
  return config.rank == 0 ? serve(config) : join(config);
}

}  // namespace deltamoe
