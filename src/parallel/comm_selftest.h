// The conformance checks every communicator backend must pass, run by the parameterised tests and
// by `deltamoe comm-selftest` across processes: each collective on inputs whose sum depends on the
// order, compared bitwise with a plain loop over the ranks in rank order.
#pragma once

#include <cstdint>
#include <string>

#include "parallel/communicator.h"

namespace deltamoe {

struct SelftestResult {
  int checks = 0;
  // FNV-1a over every output of every check: equal on all ranks and backends for one world size.
  uint64_t checksum = 0;
  // The all_reduce check's own digest; a job-wide value that shows bitwise agreement.
  std::string summary;
};

// Runs the checks collectively (every rank of `comm` calls it). Throws deltamoe::Error naming the
// check, element, expected and received values on the first wrong result.
SelftestResult run_comm_selftest(Communicator& comm);

// The job checksum of run_comm_selftest on `ranks` ThreadComm ranks: the reference every other
// backend's checksum must equal for that world size (computed once per size, then remembered).
uint64_t thread_comm_selftest_checksum(int ranks);

}  // namespace deltamoe
