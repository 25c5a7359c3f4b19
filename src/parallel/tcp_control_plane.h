// TcpComm's control plane over the rendezvous connections (a star around rank 0), run by one
// thread per process: heartbeats carrying each rank's activity, abort broadcast, host barriers and
// all-gathers, a dead or silent rank turned into a job-wide abort naming it, and the goodbye that
// makes a normal exit no fault. Protocol: docs/parallel.md "Control plane".
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "parallel/activity.h"
#include "parallel/comm_options.h"
#include "parallel/control_plane.h"
#include "parallel/rendezvous.h"

namespace deltamoe {

class TcpControlPlane final : public ControlPlane {
 public:
  // Takes the connections of a finished rendezvous and starts the control thread.
  TcpControlPlane(RendezvousResult rendezvous, int rank, std::shared_ptr<RankActivity> activity,
                  const CommOptions& options);
  // Says goodbye (rank 0: waits for every other rank's goodbye, at most the deadline) unless the job
  // was aborted, then stops the thread.
  ~TcpControlPlane() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void barrier(std::string_view label) override;
  std::vector<std::string> all_gather(std::string_view mine, std::string_view label) override;
  // Sets the job's abort message here and sends it to every rank (through rank 0).
  void abort(std::string_view message) override;

  bool aborted() const;
  std::string abort_message() const;
  // Readable once the job is aborted: the data plane polls it beside its sockets.
  int abort_fd() const { return abort_fd_; }

  // The data plane lost its connection to `blamed` ranks (stall = false), or made no progress for the
  // deadline while waiting on them (stall = true). Rank 0 completes `message` with what the ranks at
  // fault last reported and aborts the job with it. For a stall those are the ranks outside
  // communication (busy or stuck while others wait), else the ones waited on.
  void report_problem(std::string_view message, const std::vector<int>& blamed, bool stall);

  const std::vector<RankInfo>& table() const { return table_; }
  const CommOptions& options() const { return options_; }

 private:
  struct Gather {
    std::string label;
    std::vector<std::string> parts;
    std::vector<bool> arrived;
    int num_arrived = 0;
    SteadyClock::time_point first_arrival;
    bool done = false;
  };

  void run();
  void send(int peer, uint32_t type, std::string_view payload);
  void handle_frame(int peer, const Frame& frame);
  void connection_lost(int peer, const std::string& reason);
  void check_timeouts();
  // `at_fault`: the ranks the message blames (a blamed rank ends with kExitCommAtFault).
  void set_abort(std::string message, const std::vector<int>& at_fault = {});  // local only
  void abort_everywhere(std::string message, const std::vector<int>& at_fault = {});
  // Rank 0: "rank 1 (pid 7 on h)<verb><activity> (reported 0.3 s ago)"; verb " was " or ", which was ".
  std::string blame(const std::vector<int>& ranks, std::string_view verb = " was ");
  std::string blame_stall(const std::vector<int>& waited_on, std::vector<int>* at_fault);  // rank 0
  std::string last_report(int rank);  // rank 0, locked: "<activity> (reported 0.3 s ago)"
  std::string who(int rank) const;
  // What a gather's latest arrival leaves to do once the lock is released: abort on a label mismatch,
  // or send every rank the parts (the kFrameGatherResult payload) when all have arrived.
  struct GatherOutcome {
    std::string mismatch;
    std::string broadcast;
    bool empty() const { return mismatch.empty() && broadcast.empty(); }
  };
  GatherOutcome gather_arrive(uint64_t seq, int rank, std::string label, std::string data);  // rank 0, locked
  void finish_gather(const GatherOutcome& outcome);                                        // rank 0, unlocked
  void heartbeat_payload(WireWriter& w);

  const int rank_;
  const int size_;
  const std::shared_ptr<RankActivity> activity_;
  const CommOptions options_;
  std::vector<RankInfo> table_;
  std::vector<Socket> sockets_;  // rank 0: to each rank; others: [0]
  std::vector<std::unique_ptr<std::mutex>> send_mutex_;
  int abort_fd_ = -1;
  int wake_fd_ = -1;  // wakes the control thread for shutdown

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::string abort_message_;
  bool at_fault_ = false;  // this rank is among the ones the abort blames
  SteadyClock::time_point abort_time_;
  bool stopping_ = false;
  // Per rank (rank 0) or for rank 0 (others): last frame time, last activity report, goodbye.
  std::vector<SteadyClock::time_point> last_heard_;
  std::vector<std::string> reported_activity_;
  std::vector<bool> reported_in_op_;
  std::vector<SteadyClock::time_point> reported_at_;
  std::vector<bool> said_bye_;
  std::vector<bool> connection_open_;
  bool finishing_ = false;
  SteadyClock::time_point finish_started_;
  // Rank 0: reports of lost data connections, held briefly so that the peer's own reason (its abort
  // request, or its control connection closing) names the fault if it comes right behind.
  struct Deferred {
    SteadyClock::time_point at;
    std::string message;
    std::vector<int> blamed;
  };
  std::vector<Deferred> deferred_;
  uint64_t gather_seq_ = 0;
  std::map<uint64_t, Gather> gathers_;                        // rank 0
  std::map<uint64_t, std::vector<std::string>> gather_results_;  // other ranks
  std::thread thread_;
};

}  // namespace deltamoe
