// ThreadComm: N ranks as threads of one process, messages handed over through shared mailboxes.
// For unit tests and CPU-engine parallel parity tests; the same collectives (HostComm) as TcpComm
// and MpiComm, so its results are bitwise theirs.
#pragma once

#include <functional>
#include <memory>

#include "parallel/comm_options.h"
#include "parallel/communicator.h"

namespace deltamoe {

// Runs fn(comm) on `num_ranks` threads, each with its rank of one world communicator, and returns
// when all have returned. If a rank throws, the job is aborted (the others' operations throw
// CommAborted naming it) and, after every thread has ended, the first rank's own error is rethrown
// as deltamoe::Error "rank R failed: ..." (CommAborted if the job was only aborted).
// options.timeout_seconds bounds how long a rank waits for another; exit_on_abort and fault are
// ignored (the ranks share one process).
void run_thread_comm(int num_ranks, const std::function<void(Communicator& comm)>& fn,
                     const CommOptions& options = {});

// A world of one rank on the calling thread (what a process uses when it runs alone).
std::unique_ptr<Communicator> make_solo_comm();

}  // namespace deltamoe
