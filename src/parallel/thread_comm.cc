// ThreadComm's transport: one mailbox per (receiver, sender) pair holding copies of the messages in
// order; a receiver waits on a condition variable with the deadline and the job's abort flag.
#include "parallel/thread_comm.h"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "core/log.h"
#include "parallel/host_comm.h"
#include "parallel/host_transport.h"

namespace deltamoe {
namespace {

struct Message {
  MessageHeader header;
  std::vector<char> bytes;
};

// State shared by the ranks of one ThreadComm job.
class ThreadWorld {
 public:
  ThreadWorld(int num_ranks, double timeout_seconds)
      : num_ranks_(num_ranks), timeout_seconds_(timeout_seconds), mailboxes_(num_ranks * num_ranks) {
    for (int r = 0; r < num_ranks; ++r) activities_.push_back(std::make_shared<RankActivity>(r));
  }

  int num_ranks() const { return num_ranks_; }
  const std::shared_ptr<RankActivity>& activity(int rank) const { return activities_[rank]; }

  void post(int from, int to, const MessageHeader& header, const void* data, int64_t bytes) {
    Message message{header, std::vector<char>(bytes)};
    if (bytes > 0) std::memcpy(message.bytes.data(), data, bytes);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      mailbox(to, from).push_back(std::move(message));
    }
    changed_.notify_all();
  }

  // Waits for the next message from `from` to `to`; throws CommAborted on abort or deadline.
  Message take(int to, int from) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds_);
    for (;;) {
      if (!abort_message_.empty()) throw CommAborted(abort_message_);
      std::deque<Message>& box = mailbox(to, from);
      if (!box.empty()) {
        Message message = std::move(box.front());
        box.pop_front();
        return message;
      }
      if (changed_.wait_until(lock, deadline) == std::cv_status::timeout && box.empty() &&
          abort_message_.empty()) {
        lock.unlock();
        char seconds[32];
        std::snprintf(seconds, sizeof(seconds), "%.1f s", timeout_seconds_);
        abort(str_cat("rank ", to, " waited ", seconds, " for rank ", from, " (", activities_[to]->describe(),
                      "); ", holdup(from)));
        lock.lock();
      }
    }
  }

  void abort(std::string_view message) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!abort_message_.empty()) return;
      abort_message_ = std::string(message);
    }
    changed_.notify_all();
  }

  std::string abort_message() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return abort_message_;
  }

  // Who holds up a rank waiting for `peer`: the ranks outside communication (busy or stuck while
  // others wait), else `peer` itself (every rank waits: they called different operations).
  std::string holdup(int peer) const {
    std::string text;
    for (int r = 0; r < num_ranks_; ++r) {
      if (activities_[r]->in_op()) continue;
      text += str_cat(text.empty() ? "held up by " : "; ", "rank ", r, ", which was ", activities_[r]->describe());
    }
    if (!text.empty()) return text;
    return str_cat("rank ", peer, " is ", activities_[peer]->describe(),
                   "; every rank is waiting in communication: they called different operations");
  }

 private:
  std::deque<Message>& mailbox(int to, int from) { return mailboxes_[to * num_ranks_ + from]; }

  const int num_ranks_;
  const double timeout_seconds_;
  std::vector<std::shared_ptr<RankActivity>> activities_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::deque<Message>> mailboxes_;
  std::string abort_message_;
};

class ThreadTransport final : public HostTransport {
 public:
  ThreadTransport(std::shared_ptr<ThreadWorld> world, int rank)
      : HostTransport(rank, world->num_ranks(), world->activity(rank)), world_(std::move(world)), control_(*this) {}

  std::string_view backend() const override { return "thread"; }

  void exchange(std::span<const SendItem> sends, std::span<const RecvItem> recvs) override {
    check_not_aborted();
    for (const SendItem& s : sends) world_->post(rank(), s.peer, s.header, s.data, s.bytes);
    for (const RecvItem& r : recvs) {
      Message message = world_->take(rank(), r.peer);
      const std::string problem = mismatch(message.header, r.expected);
      if (!problem.empty()) {
        world_->abort(problem);
        throw CommAborted(problem);
      }
      if (r.bytes > 0) std::memcpy(r.data, message.bytes.data(), r.bytes);
    }
  }

  void abort(std::string_view message) override { world_->abort(message); }
  bool aborted() const override { return !world_->abort_message().empty(); }
  void check_not_aborted() const override {
    const std::string message = world_->abort_message();
    if (!message.empty()) throw CommAborted(message);
  }
  ControlPlane& control() override { return control_; }

 private:
  std::shared_ptr<ThreadWorld> world_;
  TransportControlPlane control_;
};

std::vector<int> iota_ranks(int n) {
  std::vector<int> ranks(n);
  for (int r = 0; r < n; ++r) ranks[r] = r;
  return ranks;
}

}  // namespace

void run_thread_comm(int num_ranks, const std::function<void(Communicator& comm)>& fn, const CommOptions& options) {
  CHECK(num_ranks >= 1, "run_thread_comm: ", num_ranks, " ranks");
  auto world = std::make_shared<ThreadWorld>(num_ranks, options.timeout_seconds);
  std::vector<std::exception_ptr> errors(num_ranks);
  std::vector<bool> own_error(num_ranks, false);
  std::vector<std::thread> threads;
  for (int r = 0; r < num_ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        HostComm comm(std::make_shared<ThreadTransport>(world, r), iota_ranks(num_ranks), kWorldCommId, "world");
        fn(comm);
      } catch (const CommAborted&) {
        errors[r] = std::current_exception();
      } catch (const std::exception& error) {
        errors[r] = std::current_exception();
        own_error[r] = true;
        world->abort(str_cat("rank ", r, " failed: ", error.what()));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int r = 0; r < num_ranks; ++r) {
    if (!own_error[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& error) {
      throw Error(str_cat("rank ", r, " failed: ", error.what()));
    }
  }
  for (int r = 0; r < num_ranks; ++r) {
    if (errors[r]) std::rethrow_exception(errors[r]);
  }
}

std::unique_ptr<Communicator> make_solo_comm() {
  auto world = std::make_shared<ThreadWorld>(1, 1.0);
  return std::make_unique<HostComm>(std::make_shared<ThreadTransport>(world, 0), std::vector<int>{0},
                                    kWorldCommId, "world");
}

}  // namespace deltamoe
