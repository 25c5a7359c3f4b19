// Fault injection for tests of the failure paths: DELTAMOE_FAULT=rank:1,at:3,kind:kill makes rank 1
// kill itself when it starts its 3rd communication operation. Only process-per-rank backends
// (TcpComm, MpiComm) arm it: in ThreadComm the ranks share one process.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace deltamoe {

enum class FaultKind : uint8_t {
  kill,  // SIGKILL itself: no goodbye, sockets closed by the kernel
  exit,  // _exit(3) without goodbye, like a crash that exits
  hang,  // the calling thread sleeps forever; the process (and its heartbeats) stays alive
  stop,  // SIGSTOP itself: the whole process freezes, heartbeats stop
  term,  // SIGTERM itself and carry on: a preemption notice that reached this rank only
};

struct FaultPlan {
  int rank = -1;
  // Fires at the start of operation number `at_op` (1-based, counted over all communicators of the
  // rank) when non-zero, else when the rank's activity label becomes exactly `at_label`.
  uint64_t at_op = 0;
  std::string at_label;
  FaultKind kind = FaultKind::kill;

  // "rank:R,at:N|LABEL,kind:kill|exit|hang|stop|term" (keys in any order; kind defaults to kill).
  // Throws on a malformed value, naming the part that is wrong.
  static FaultPlan parse(std::string_view text);
  // The plan in DELTAMOE_FAULT, if set.
  static std::optional<FaultPlan> from_env();
  std::string describe() const;
};

std::string_view fault_kind_name(FaultKind kind);

// Logs "fault injection: rank R <kind> at <where>" and carries the fault out: returns only for
// term (after raising SIGTERM, whose handler decides what happens next).
void inject_fault(const FaultPlan& plan, std::string_view where);

}  // namespace deltamoe
