// The control thread and the main-thread calls of TcpControlPlane. The mutex guards the shared
// state; it is never held while writing to a socket (each socket has its own send mutex).
#include "parallel/tcp_control_plane.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <exception>

#include "core/error.h"
#include "core/log.h"
#include "parallel/communicator.h"

namespace deltamoe {
namespace {

std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", seconds);
  return text;
}

double since(SteadyClock::time_point t) { return std::chrono::duration<double>(SteadyClock::now() - t).count(); }

std::string list_ranks(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) text += str_cat(i ? ", " : "", ranks[i]);
  return text;
}

bool gather_complete(const std::vector<bool>& arrived) {
  for (bool a : arrived) {
    if (!a) return false;
  }
  return true;
}

}  // namespace

TcpControlPlane::TcpControlPlane(RendezvousResult rendezvous, int rank, std::shared_ptr<RankActivity> activity,
                                 const CommOptions& options)
    : rank_(rank),
      size_(static_cast<int>(rendezvous.table.size())),
      activity_(std::move(activity)),
      options_(options),
      table_(std::move(rendezvous.table)),
      sockets_(std::move(rendezvous.control)) {
  sockets_.resize(size_);
  for (int r = 0; r < size_; ++r) send_mutex_.push_back(std::make_unique<std::mutex>());
  abort_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  CHECK(abort_fd_ >= 0 && wake_fd_ >= 0, "control plane: eventfd failed");
  const auto now = SteadyClock::now();
  last_heard_.assign(size_, now);
  reported_activity_.assign(size_, "");
  reported_in_op_.assign(size_, true);
  reported_at_.assign(size_, now);
  said_bye_.assign(size_, false);
  connection_open_.assign(size_, false);
  for (int r = 0; r < size_; ++r) connection_open_[r] = sockets_[r].valid();
  if (size_ == 1) return;
  if (rank_ != 0) {
    // A new label goes to rank 0 at once, so a rank that dies right after has told what it was doing.
    activity_->on_label_change([this] {
      WireWriter w;
      heartbeat_payload(w);
      send(0, kFrameHeartbeat, w.bytes());
    });
  }
  thread_ = std::thread([this] { run(); });
}

TcpControlPlane::~TcpControlPlane() {
  activity_->on_label_change(nullptr);
  if (size_ > 1) {
    if (!aborted() && std::uncaught_exceptions() > 0) {
      abort_everywhere(str_cat("rank ", rank_, " (pid ", table_[rank_].pid, " on ", table_[rank_].host,
                               ") ended with an error (see its log) while ", activity_->describe()));
    }
    if (!aborted()) {
      if (rank_ != 0) {
        send(0, kFrameBye, "");
      } else {
        std::unique_lock<std::mutex> lock(mutex_);
        finishing_ = true;
        finish_started_ = SteadyClock::now();
        changed_.wait(lock, [&] {
          if (!abort_message_.empty()) return true;
          for (int r = 1; r < size_; ++r) {
            if (!said_bye_[r]) return false;
          }
          return true;
        });
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
    if (thread_.joinable()) thread_.join();
  }
  ::close(abort_fd_);
  ::close(wake_fd_);
}

std::string TcpControlPlane::who(int rank) const {
  const RankInfo& info = table_[rank];
  return str_cat("rank ", rank, " (pid ", info.pid, " on ", info.host, ")");
}

void TcpControlPlane::heartbeat_payload(WireWriter& w) {
  w.u32(activity_->in_op() ? 1 : 0).str(activity_->describe());
}

void TcpControlPlane::send(int peer, uint32_t type, std::string_view payload) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!connection_open_[peer]) return;
  }
  std::string problem;
  {
    std::lock_guard<std::mutex> lock(*send_mutex_[peer]);
    problem = write_frame(sockets_[peer].fd(), type, payload, deadline_after(options_.timeout_seconds));
  }
  // A closed connection is left to the control thread's reader: frames the peer sent before closing
  // (rank 0's abort naming the rank at fault) are still queued, and the reader handles them before
  // it meets the end. Declaring the loss here would stop reading them and blame the closing rank.
  if (!problem.empty() && problem != kPeerClosed) connection_lost(peer, str_cat("sending failed: ", problem));
}

bool TcpControlPlane::aborted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !abort_message_.empty();
}

std::string TcpControlPlane::abort_message() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return abort_message_;
}

void TcpControlPlane::set_abort(std::string message, const std::vector<int>& at_fault) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!abort_message_.empty()) return;
    abort_message_ = message;
    abort_time_ = SteadyClock::now();
    at_fault_ = std::find(at_fault.begin(), at_fault.end(), rank_) != at_fault.end();
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(abort_fd_, &one, sizeof(one));
  changed_.notify_all();
  log_error("rank ", rank_, ": job aborted: ", message);
}

void TcpControlPlane::abort_everywhere(std::string message, const std::vector<int>& at_fault) {
  if (aborted()) return;
  set_abort(message, at_fault);
  WireWriter w;
  if (rank_ == 0) {
    w.str(message).i32(static_cast<int32_t>(at_fault.size()));
    for (int r : at_fault) w.i32(r);
    for (int r = 1; r < size_; ++r) send(r, kFrameAbort, w.bytes());
  } else {
    w.str(message).u32(0).i32(0);
    send(0, kFrameAbortRequest, w.bytes());
  }
}

void TcpControlPlane::abort(std::string_view message) { abort_everywhere(std::string(message)); }

std::string TcpControlPlane::last_report(int rank) {
  if (rank == rank_) return activity_->describe();
  if (reported_activity_[rank].empty()) return "(no report yet)";
  std::string text = str_cat(reported_activity_[rank], " (reported ", seconds_text(since(reported_at_[rank])), " ago");
  const double silent = since(last_heard_[rank]);
  if (silent > 2 * options_.heartbeat_interval()) {
    text += str_cat("; nothing heard from it for ", seconds_text(silent), ": stopped or unreachable");
  }
  return text + ")";
}

std::string TcpControlPlane::blame(const std::vector<int>& ranks, std::string_view verb) {
  std::string text;
  std::lock_guard<std::mutex> lock(mutex_);
  for (int r : ranks) text += str_cat(text.empty() ? "" : "; ", who(r), verb, last_report(r));
  return text;
}

std::string TcpControlPlane::blame_stall(const std::vector<int>& waited_on, std::vector<int>* at_fault) {
  std::vector<int> outside;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int r = 0; r < size_; ++r) {
      const bool in_op = r == rank_ ? activity_->in_op() : reported_in_op_[r];
      if (!in_op && (r == rank_ || connection_open_[r])) outside.push_back(r);
    }
  }
  if (!outside.empty()) {
    *at_fault = outside;
    return str_cat("held up by ", blame(outside, ", which was "));
  }
  *at_fault = waited_on;
  return str_cat(blame(waited_on), "; every rank is waiting in communication: they called different operations");
}

void TcpControlPlane::report_problem(std::string_view message, const std::vector<int>& blamed, bool stall) {
  if (aborted()) return;
  if (rank_ == 0) {
    if (stall) {
      std::vector<int> at_fault;
      const std::string culprits = blame_stall(blamed, &at_fault);
      abort_everywhere(str_cat(message, "; ", culprits), at_fault);
    } else {
      std::lock_guard<std::mutex> lock(mutex_);
      deferred_.push_back({SteadyClock::now(), std::string(message), blamed});
    }
    return;
  }
  WireWriter w;
  w.str(message).u32(stall ? 1 : 0).i32(static_cast<int32_t>(blamed.size()));
  for (int r : blamed) w.i32(r);
  send(0, kFrameAbortRequest, w.bytes());
}

void TcpControlPlane::connection_lost(int peer, const std::string& reason) {
  bool said_bye;
  double heard;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!connection_open_[peer]) return;
    connection_open_[peer] = false;
    said_bye = said_bye_[peer];
    heard = since(last_heard_[peer]);
    if (!abort_message_.empty() || stopping_) return;
  }
  if (rank_ == 0) {
    if (said_bye) return;  // finished normally
    std::string report;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      report = last_report(peer);
    }
    abort_everywhere(str_cat(who(peer), " closed its control connection without saying goodbye (", reason,
                             "): the process exited or was killed. It last reported: ", report),
                     {peer});
  } else {
    set_abort(str_cat(who(0), " closed the control connection (", reason, ", last heard ", seconds_text(heard),
                      " ago): rank 0 exited or was killed"),
              {0});
  }
}

TcpControlPlane::GatherOutcome TcpControlPlane::gather_arrive(uint64_t seq, int rank, std::string label,
                                                              std::string data) {
  Gather& g = gathers_[seq];
  if (g.arrived.empty()) {
    g.label = label;
    g.parts.resize(size_);
    g.arrived.assign(size_, false);
    g.first_arrival = SteadyClock::now();
  }
  if (g.label != label) {
    // Reported by the caller after unlocking (see handle_frame / all_gather).
    g.label = str_cat("\x01", "rank ", rank, " called control-plane operation '", label, "' (#", seq,
                      ") while others called '", g.label, "': the ranks run different code paths");
  }
  g.parts[rank] = std::move(data);
  if (!g.arrived[rank]) ++g.num_arrived;
  g.arrived[rank] = true;
  GatherOutcome outcome;
  if (!g.label.empty() && g.label[0] == '\x01') {
    outcome.mismatch = g.label.substr(1);
  } else if (gather_complete(g.arrived)) {
    WireWriter w;
    w.u64(seq).i32(size_);
    for (const std::string& part : g.parts) w.str(part);
    outcome.broadcast = w.bytes();
    g.done = true;
  }
  return outcome;
}

void TcpControlPlane::finish_gather(const GatherOutcome& outcome) {
  if (!outcome.mismatch.empty()) {
    abort_everywhere(outcome.mismatch);
    return;
  }
  if (outcome.broadcast.empty()) return;
  for (int p = 1; p < size_; ++p) send(p, kFrameGatherResult, outcome.broadcast);
  changed_.notify_all();
}

void TcpControlPlane::handle_frame(int peer, const Frame& frame) {
  const std::string what = str_cat("control message ", frame.type, " from rank ", peer);
  WireReader r(frame.payload, what);
  switch (frame.type) {
    case kFrameHeartbeat:
      if (rank_ == 0) {
        const bool in_op = r.u32() != 0;
        std::string activity = r.str();
        std::lock_guard<std::mutex> lock(mutex_);
        reported_in_op_[peer] = in_op;
        reported_activity_[peer] = std::move(activity);
        reported_at_[peer] = SteadyClock::now();
      }
      return;
    case kFrameAbort: {
      std::string message = r.str();
      std::vector<int> at_fault(r.i32());
      for (int& b : at_fault) b = r.i32();
      set_abort(std::move(message), at_fault);
      return;
    }
    case kFrameAbortRequest: {
      CHECK(rank_ == 0, what, " is meant for rank 0");
      std::string message = r.str();
      const bool stall = r.u32() != 0;
      std::vector<int> blamed(r.i32());
      for (int& b : blamed) {
        b = r.i32();
        CHECK(b >= 0 && b < size_, what, ": blames rank ", b);
      }
      if (!stall && !blamed.empty()) {
        std::lock_guard<std::mutex> lock(mutex_);
        deferred_.push_back({SteadyClock::now(), std::move(message), std::move(blamed)});
        return;
      }
      std::vector<int> at_fault;
      if (!blamed.empty()) message += str_cat("; ", blame_stall(blamed, &at_fault));
      abort_everywhere(message, at_fault);
      return;
    }
    case kFrameGather: {
      CHECK(rank_ == 0, what, " is meant for rank 0");
      const uint64_t seq = r.u64();
      std::string label = r.str();
      std::string data = r.str();
      GatherOutcome outcome;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        outcome = gather_arrive(seq, peer, std::move(label), std::move(data));
      }
      finish_gather(outcome);
      return;
    }
    case kFrameGatherResult: {
      const uint64_t seq = r.u64();
      std::vector<std::string> parts(r.i32());
      for (std::string& part : parts) part = r.str();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        gather_results_[seq] = std::move(parts);
      }
      changed_.notify_all();
      return;
    }
    case kFrameBye: {
      std::lock_guard<std::mutex> lock(mutex_);
      said_bye_[peer] = true;
      changed_.notify_all();
      return;
    }
    default:
      RAISE(what, " has an unknown type (a different deltamoe build?)");
  }
}

void TcpControlPlane::check_timeouts() {
  const double limit = options_.timeout_seconds;
  std::string problem;
  std::vector<int> blamed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!abort_message_.empty()) return;
    const double settle = std::min(1.0, std::max(0.1, limit / 4));
    if (!deferred_.empty() && since(deferred_.front().at) > settle) {
      problem = deferred_.front().message;
      blamed = deferred_.front().blamed;
    }
    for (int r = 0; r < size_ && problem.empty(); ++r) {
      if (r == rank_ || !connection_open_[r] || said_bye_[r]) continue;
      const double silent = since(last_heard_[r]);
      if (silent > limit) {
        problem = str_cat(who(r), " sent nothing for ", seconds_text(silent), " (heartbeats every ",
                          seconds_text(options_.heartbeat_interval()), ", deadline ", seconds_text(limit),
                          "): the process is stopped or its host is unreachable");
        blamed.push_back(r);
      }
    }
    if (rank_ == 0 && problem.empty()) {
      for (auto& [seq, g] : gathers_) {
        if (g.done || since(g.first_arrival) <= limit) continue;
        std::vector<int> missing;
        for (int r = 0; r < size_; ++r) {
          if (!g.arrived[r]) missing.push_back(r);
        }
        problem = str_cat("control-plane operation '", g.label, "' (#", seq, "): ranks ", list_ranks(missing),
                          " did not arrive within ", seconds_text(limit));
        blamed = missing;
        break;
      }
      if (problem.empty() && finishing_ && since(finish_started_) > limit) {
        std::vector<int> missing;
        for (int r = 1; r < size_; ++r) {
          if (!said_bye_[r]) missing.push_back(r);
        }
        problem = str_cat("rank 0 finished, but ranks ", list_ranks(missing), " did not finish within ",
                          seconds_text(limit));
        blamed = missing;
      }
    }
  }
  if (problem.empty()) return;
  if (rank_ == 0) {
    abort_everywhere(str_cat(problem, blamed.empty() ? "" : ". ", blame(blamed)), blamed);
  } else {
    set_abort(problem, blamed);  // rank 0 is the silent one: nobody to tell
  }
}

void TcpControlPlane::run() {
  std::vector<FrameReader> readers(size_);
  auto next_heartbeat = SteadyClock::now();
  const auto interval = std::chrono::duration_cast<SteadyClock::duration>(
      std::chrono::duration<double>(options_.heartbeat_interval()));
  for (;;) {
    std::vector<pollfd> fds{{wake_fd_, POLLIN, 0}};
    std::vector<int> peers{-1};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
      for (int r = 0; r < size_; ++r) {
        if (connection_open_[r]) {
          fds.push_back({sockets_[r].fd(), POLLIN, 0});
          peers.push_back(r);
        }
      }
    }
    ::poll(fds.data(), fds.size(), 50);
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const int peer = peers[i];
      std::string problem;
      try {
        problem = readers[peer].read_available(fds[i].fd);
        while (std::optional<Frame> frame = readers[peer].next()) {
          {
            std::lock_guard<std::mutex> lock(mutex_);
            last_heard_[peer] = SteadyClock::now();
          }
          handle_frame(peer, *frame);
        }
      } catch (const std::exception& error) {
        problem = str_cat("bad control message: ", error.what());
      }
      if (!problem.empty()) connection_lost(peer, problem);
    }
    if (SteadyClock::now() >= next_heartbeat) {
      next_heartbeat = SteadyClock::now() + interval;
      if (rank_ == 0) {
        for (int r = 1; r < size_; ++r) send(r, kFrameHeartbeat, "");
      } else {
        WireWriter w;
        heartbeat_payload(w);
        send(0, kFrameHeartbeat, w.bytes());
      }
    }
    check_timeouts();
    bool exit_now = false;
    bool at_fault = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      exit_now = !abort_message_.empty() && options_.exit_on_abort && since(abort_time_) > options_.abort_grace();
      at_fault = at_fault_;
    }
    if (exit_now) {
      log_error("rank ", rank_, ": ending the process ", seconds_text(options_.abort_grace()),
                " after the abort (its main thread did not return in time; ", activity_->describe(), ")");
      std::fflush(stdout);
      _exit(at_fault ? kExitCommAtFault : kExitCommAborted);
    }
  }
}

std::vector<std::string> TcpControlPlane::all_gather(std::string_view mine, std::string_view label) {
  if (size_ == 1) return {std::string(mine)};
  activity_->begin_op(str_cat("control-plane all_gather '", label, "'"));
  struct EndOp {
    RankActivity& activity;
    ~EndOp() { activity.end_op(); }
  } end_op{*activity_};
  std::unique_lock<std::mutex> lock(mutex_);
  if (!abort_message_.empty()) throw CommAborted(abort_message_);
  const uint64_t seq = ++gather_seq_;
  if (rank_ == 0) {
    const GatherOutcome outcome = gather_arrive(seq, 0, std::string(label), std::string(mine));
    if (!outcome.empty()) {
      lock.unlock();
      finish_gather(outcome);
      lock.lock();
    }
    changed_.wait(lock, [&] { return !abort_message_.empty() || gathers_[seq].done; });
    if (!abort_message_.empty()) throw CommAborted(abort_message_);
    std::vector<std::string> parts = std::move(gathers_[seq].parts);
    gathers_.erase(seq);
    return parts;
  }
  lock.unlock();
  WireWriter w;
  w.u64(seq).str(label).str(mine);
  send(0, kFrameGather, w.bytes());
  lock.lock();
  changed_.wait(lock, [&] { return !abort_message_.empty() || gather_results_.count(seq) > 0; });
  if (!abort_message_.empty()) throw CommAborted(abort_message_);
  std::vector<std::string> parts = std::move(gather_results_[seq]);
  gather_results_.erase(seq);
  CHECK(static_cast<int>(parts.size()) == size_, "control plane: all_gather result with ", parts.size(), " parts");
  return parts;
}

void TcpControlPlane::barrier(std::string_view label) { all_gather("", label); }

}  // namespace deltamoe
