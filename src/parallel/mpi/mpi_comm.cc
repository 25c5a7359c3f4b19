// MpiComm's transport. Each message is a 40-byte header then the payload (in pieces of at most
// 1 GiB, MPI counts being int), all with one tag; MPI keeps messages between two ranks in order,
// and a receive's payload is posted only after its header arrived and matched.
#include "parallel/mpi/mpi_comm.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <chrono>
#include <cstdio>
#include <deque>
#include <thread>

#include "core/log.h"
#include "parallel/host_comm.h"
#include "parallel/host_transport.h"

namespace deltamoe {
namespace {

constexpr int kTag = 7101;
constexpr int64_t kMaxPiece = int64_t{1} << 30;

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(rc, text, &length);
  RAISE("MPI call ", what, " failed: ", std::string(text, length));
}

std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", seconds);
  return text;
}

class MpiTransport final : public HostTransport {
 public:
  MpiTransport(MPI_Comm comm, int rank, int size, std::shared_ptr<RankActivity> activity, const CommOptions& options,
               bool finalize)
      : HostTransport(rank, size, std::move(activity)), comm_(comm), options_(options), finalize_(finalize),
        control_(*this) {}

  ~MpiTransport() override {
    if (aborted_) return;  // MPI_Abort has ended (or is ending) the job
    MPI_Comm_free(&comm_);
    if (finalize_) MPI_Finalize();
  }

  std::string_view backend() const override { return "mpi"; }
  ControlPlane& control() override { return control_; }
  bool aborted() const override { return aborted_; }
  void check_not_aborted() const override {
    if (!aborted_) return;
    std::lock_guard<std::mutex> lock(mutex_);
    throw CommAborted(abort_message_);
  }

  // With exit_on_abort (the default) this ends every rank through MPI_Abort, from whichever thread
  // calls it; otherwise later operations on this rank throw CommAborted.
  void abort(std::string_view message) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (aborted_) return;
      abort_message_ = std::string(message);
      aborted_ = true;
    }
    log_error("rank ", rank(), ": job aborted: ", message);
    if (options_.exit_on_abort) {
      std::fflush(stdout);
      MPI_Abort(MPI_COMM_WORLD, kExitCommAborted);
    }
  }

  void exchange(std::span<const SendItem> sends, std::span<const RecvItem> recvs) override;

 private:
  MPI_Comm comm_;
  CommOptions options_;
  bool finalize_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex mutex_;
  std::string abort_message_;
  TransportControlPlane control_;
};

void MpiTransport::exchange(std::span<const SendItem> sends, std::span<const RecvItem> recvs) {
  check_not_aborted();
  std::vector<MPI_Request> send_requests;
  for (const SendItem& s : sends) {
    send_requests.emplace_back();
    check_mpi(MPI_Isend(&s.header, sizeof(MessageHeader), MPI_BYTE, s.peer, kTag, comm_, &send_requests.back()),
              "MPI_Isend");
    for (int64_t offset = 0; offset < s.bytes; offset += kMaxPiece) {
      send_requests.emplace_back();
      check_mpi(MPI_Isend(static_cast<const char*>(s.data) + offset, static_cast<int>(std::min(kMaxPiece, s.bytes - offset)),
                          MPI_BYTE, s.peer, kTag, comm_, &send_requests.back()),
                "MPI_Isend");
    }
  }
  // Per peer, receives in order: header, then (once it matched) the payload pieces.
  struct PeerQueue {
    std::deque<const RecvItem*> items;
    MessageHeader header{};
    std::vector<MPI_Request> requests;  // outstanding for the front item
    bool header_done = false;
  };
  std::vector<PeerQueue> queues(size());
  for (const RecvItem& r : recvs) queues[r.peer].items.push_back(&r);
  auto post_header = [&](int peer) {
    PeerQueue& q = queues[peer];
    q.header_done = false;
    q.requests.assign(1, MPI_REQUEST_NULL);
    check_mpi(MPI_Irecv(&q.header, sizeof(MessageHeader), MPI_BYTE, peer, kTag, comm_, &q.requests[0]), "MPI_Irecv");
  };
  for (int p = 0; p < size(); ++p) {
    if (!queues[p].items.empty()) post_header(p);
  }
  auto last_progress = std::chrono::steady_clock::now();
  for (;;) {
    bool progressed = false;
    bool receiving = false;
    for (int p = 0; p < size(); ++p) {
      PeerQueue& q = queues[p];
      if (q.items.empty()) continue;
      int done = 0;
      check_mpi(MPI_Testall(static_cast<int>(q.requests.size()), q.requests.data(), &done, MPI_STATUSES_IGNORE),
                "MPI_Testall");
      if (!done) {
        receiving = true;
        continue;
      }
      progressed = true;
      const RecvItem& item = *q.items.front();
      if (!q.header_done) {
        const std::string problem = mismatch(q.header, item.expected);
        if (!problem.empty()) {
          abort(problem);
          throw CommAborted(problem);
        }
        q.header_done = true;
        q.requests.clear();
        for (int64_t offset = 0; offset < item.bytes; offset += kMaxPiece) {
          q.requests.emplace_back();
          check_mpi(MPI_Irecv(static_cast<char*>(item.data) + offset, static_cast<int>(std::min(kMaxPiece, item.bytes - offset)),
                              MPI_BYTE, p, kTag, comm_, &q.requests.back()),
                    "MPI_Irecv");
        }
        receiving = true;
        continue;
      }
      q.items.pop_front();
      if (!q.items.empty()) {
        post_header(p);
        receiving = true;
      }
    }
    int sends_done = 0;
    check_mpi(MPI_Testall(static_cast<int>(send_requests.size()), send_requests.data(), &sends_done,
                          MPI_STATUSES_IGNORE),
              "MPI_Testall");
    if (!receiving && sends_done) return;
    const auto now = std::chrono::steady_clock::now();
    if (progressed) last_progress = now;
    const double idle = std::chrono::duration<double>(now - last_progress).count();
    if (idle > options_.timeout_seconds) {
      std::string waiting;
      for (int p = 0; p < size(); ++p) {
        if (!queues[p].items.empty()) waiting += str_cat(waiting.empty() ? "" : ", ", p);
      }
      if (waiting.empty()) waiting = "the receivers of its sends";
      const std::string message = str_cat("rank ", rank(), " waited ", seconds_text(idle), " for rank(s) ", waiting,
                                          " with no data moving, while ", activity()->describe(),
                                          " (MPI backend: the other ranks' activity is not known here)");
      abort(message);
      throw CommAborted(message);
    }
    if (!progressed) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace

std::unique_ptr<Communicator> connect_mpi_comm(const CommOptions& options) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  bool finalize = false;
  if (!initialized) {
    int provided = 0;
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    finalize = true;
  }
  MPI_Comm comm;
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
  // Errors come back as codes (reported by check_mpi) instead of ending the job silently.
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  auto activity = std::make_shared<RankActivity>(rank);
  if (options.fault) activity->arm_fault(*options.fault);
  auto transport = std::make_shared<MpiTransport>(comm, rank, size, activity, options, finalize);
  std::vector<int> members(size);
  for (int r = 0; r < size; ++r) members[r] = r;
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int host_length = 0;
  MPI_Get_processor_name(host, &host_length);
  int version = 0, subversion = 0;
  MPI_Get_version(&version, &subversion);
  log_info("rank ", rank, " of ", size, " on ", host, ": MpiComm ready (MPI ", version, ".", subversion, ")");
  return std::make_unique<HostComm>(std::move(transport), std::move(members), kWorldCommId, "world");
}

}  // namespace deltamoe
