// TCP rendezvous on rank 0: every rank says hello (magic, protocol version, build, run id, rank,
// world, host, pid, data port), rank 0 checks that each rank came exactly once and that all agree,
// then sends everyone the rank table. The connections stay open as the control plane.
#pragma once

#include <string>
#include <vector>

#include "parallel/socket_util.h"

namespace deltamoe {

inline constexpr uint32_t kRendezvousMagic = 0x444d5256;  // "DMRV"
inline constexpr uint32_t kProtocolVersion = 1;

// Frame types on the control connections (rendezvous, then control plane).
enum ControlFrame : uint32_t {
  kFrameHello = 1,       // worker -> 0
  kFrameWelcome,         // 0 -> worker: rank table
  kFrameRefuse,          // 0 -> worker: reason; the worker fails with it
  kFrameHeartbeat,       // both ways; worker -> 0 carries its activity
  kFrameAbort,           // 0 -> workers: the job's abort message
  kFrameAbortRequest,    // worker -> 0: a problem to broadcast (message, ranks it blames)
  kFrameGather,          // worker -> 0: contribution to a host all_gather
  kFrameGatherResult,    // 0 -> workers: all contributions
  kFrameBye,             // worker -> 0: finished normally; its connection closing is no fault
};

struct RankInfo {
  int rank = 0;
  int local_rank = 0;
  int pid = 0;
  std::string host;     // gethostname()
  std::string address;  // IPv4 address rank 0 saw it connect from ("" for rank 0 itself)
  int data_port = 0;    // its TcpComm data listener
};

struct RendezvousConfig {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;
  int port = 0;
  std::string run_id;
  // Rank 0: a socket already listening on `port` to use instead of binding it (LaunchEnv's
  // rendezvous_fd); -1 to bind. Taken over (and closed) when it is a socket listening on `port`;
  // anything else is left alone with a warning, and the port is bound.
  int listener_fd = -1;
  double timeout_seconds = 300;
  int data_port = 0;
  // Where the address came from, for messages ("MASTER_ADDR=..., port MASTER_PORT+1 (...)").
  std::string origin;
};

struct RendezvousResult {
  std::vector<RankInfo> table;  // indexed by rank
  // Rank 0: control[r] is the connection to rank r (r >= 1). Other ranks: control[0] to rank 0.
  std::vector<Socket> control;
};

// Runs the rendezvous for this rank. Throws deltamoe::Error with what went wrong and where:
// port in use, rank 0 unreachable, duplicate / out-of-range ranks, disagreeing world size, run id
// or build, and on timeout the ranks that never came.
RendezvousResult rendezvous(const RendezvousConfig& config);

std::string this_host_name();

}  // namespace deltamoe
