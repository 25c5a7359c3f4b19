// Timeouts and failure behaviour shared by the communicator backends, with their environment
// variables (docs/parallel.md lists them).
#pragma once

#include <optional>

#include "parallel/fault_injection.h"

namespace deltamoe {

struct CommOptions {
  // Deadline for a dead or stuck rank: a rank that makes no progress in an operation others wait
  // on, or sends no heartbeat, for this long aborts the job (DELTAMOE_COMM_TIMEOUT, seconds).
  double timeout_seconds = 30;
  // How long rank 0 waits for all ranks to arrive, and the others for rank 0 to answer
  // (DELTAMOE_RDZV_TIMEOUT, seconds).
  double rendezvous_timeout_seconds = 300;
  // Heartbeat period of the TCP control plane; 0 = min(5 s, timeout / 5).
  double heartbeat_seconds = 0;
  // After an abort, how long the main thread has to notice it and exit by itself before the
  // control plane ends the process (exit status kExitCommAborted); 0 = min(5 s, timeout / 2).
  double abort_grace_seconds = 0;
  // Process backends end the process after an abort (see abort_grace_seconds). Tests that run
  // several TCP ranks as threads of one process turn this off.
  bool exit_on_abort = true;
  // DELTAMOE_FAULT (process-per-rank backends only).
  std::optional<FaultPlan> fault;

  double heartbeat_interval() const;
  double abort_grace() const;

  // Defaults overridden by DELTAMOE_COMM_TIMEOUT, DELTAMOE_RDZV_TIMEOUT and DELTAMOE_FAULT.
  // Throws on malformed values, naming the variable.
  static CommOptions from_env();
};

}  // namespace deltamoe
