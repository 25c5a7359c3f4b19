// The job's host control plane: barriers, small all-gathers and commit votes between all ranks,
// and abort. TcpComm runs it over the rendezvous connections to rank 0 (with heartbeats); the
// other backends over their own transport. Never for tensor data.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace deltamoe {

// Result of a vote: every rank's (ok, detail), and whether all were ok.
struct VoteResult {
  bool all_ok = true;
  std::vector<bool> ok;              // indexed by world rank
  std::vector<std::string> details;  // indexed by world rank
  // "rank 2: <detail>; rank 5: <detail>" for the ranks that voted no ("" when all_ok).
  std::string failures() const;
};

class ControlPlane {
 public:
  virtual ~ControlPlane() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Every rank of the job calls these in the same order; `label` names the step for messages
  // ("checkpoint 200 commit"). A rank that does not arrive within the deadline aborts the job.
  virtual void barrier(std::string_view label) = 0;
  // Each rank contributes a small byte string (up to a few MB); every rank gets all, indexed by rank.
  virtual std::vector<std::string> all_gather(std::string_view mine, std::string_view label) = 0;
  // A commit vote: all_gather of (ok, detail). Every rank gets the same result.
  VoteResult vote(bool ok, std::string_view detail, std::string_view label);

  // Same as Communicator::abort: ends the job everywhere.
  virtual void abort(std::string_view reason) = 0;
};

}  // namespace deltamoe
