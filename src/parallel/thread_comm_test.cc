// ThreadComm's failure paths (shared with every host backend through HostComm): a failing rank, a
// stuck rank past the deadline, ranks calling different operations or counts, abort, groups.
#include "parallel/thread_comm.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "parallel/control_plane.h"

namespace deltamoe {
namespace {

using Clock = std::chrono::steady_clock;

// Runs fn on n ranks and returns each rank's exception message ("" if it returned normally) and
// the message run_thread_comm threw.
struct Outcome {
  std::vector<std::string> rank_errors;
  std::vector<bool> aborted;
  std::string thrown;
};

Outcome run_and_collect(int n, const std::function<void(Communicator&)>& fn, double timeout = 5) {
  Outcome outcome;
  outcome.rank_errors.resize(n);
  outcome.aborted.resize(n, false);
  std::mutex mutex;
  CommOptions options;
  options.timeout_seconds = timeout;
  try {
    run_thread_comm(n, [&](Communicator& comm) {
      try {
        fn(comm);
      } catch (const CommAborted& error) {
        std::lock_guard<std::mutex> lock(mutex);
        outcome.rank_errors[comm.rank()] = error.what();
        outcome.aborted[comm.rank()] = true;
        throw;
      } catch (const std::exception& error) {
        std::lock_guard<std::mutex> lock(mutex);
        outcome.rank_errors[comm.rank()] = error.what();
        throw;
      }
    }, options);
  } catch (const std::exception& error) {
    outcome.thrown = error.what();
  }
  return outcome;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(ThreadComm, FailingRankAbortsTheOthersAndIsRethrown) {
  const Outcome outcome = run_and_collect(3, [](Communicator& comm) {
    float x = 1;
    comm.all_reduce(&x, &x, 1, DType::f32, ReduceOp::sum);
    if (comm.rank() == 1) throw Error("boom in rank 1");
    comm.all_reduce(&x, &x, 1, DType::f32, ReduceOp::sum);
  });
  EXPECT_TRUE(contains(outcome.thrown, "rank 1 failed: boom in rank 1")) << outcome.thrown;
  for (int r : {0, 2}) {
    EXPECT_TRUE(outcome.aborted[r]) << r;
    EXPECT_TRUE(contains(outcome.rank_errors[r], "rank 1 failed: boom in rank 1")) << outcome.rank_errors[r];
  }
}

TEST(ThreadComm, StuckRankIsNamedWithItsLabelAfterTheDeadline) {
  const auto start = Clock::now();
  const Outcome outcome = run_and_collect(3, [](Communicator& comm) {
    comm.set_activity(str_cat("rank ", comm.rank(), " step 7"));
    if (comm.rank() == 2) {
      // Stuck outside communication until the others have given up on it.
      while (!comm.aborted()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    double x = 1;
    comm.all_reduce(&x, &x, 1, DType::f64, ReduceOp::sum);
  }, 0.3);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_LT(seconds, 3.0);
  EXPECT_GE(seconds, 0.3);
  for (int r : {0, 1}) {
    const std::string& message = outcome.rank_errors[r];
    EXPECT_TRUE(outcome.aborted[r]) << message;
    EXPECT_TRUE(contains(message, "held up by rank 2, which was outside communication")) << message;
    EXPECT_TRUE(contains(message, "label 'rank 2 step 7'")) << message;
    EXPECT_TRUE(contains(message, "all_reduce #1 on 'world'")) << message;
  }
}

TEST(ThreadComm, DifferentCollectivesAreCaughtAtTheFirstMessage) {
  const Outcome outcome = run_and_collect(2, [](Communicator& comm) {
    float in[2] = {1, 2}, out[4];
    if (comm.rank() == 0) comm.all_reduce(in, out, 2, DType::f32, ReduceOp::sum);
    else comm.all_gather(in, out, 2, DType::f32);
  });
  ASSERT_TRUE(outcome.aborted[0] && outcome.aborted[1]) << outcome.thrown;
  EXPECT_TRUE(contains(outcome.thrown, "called different operations")) << outcome.thrown;
  EXPECT_TRUE(contains(outcome.thrown, "all_gather #1 on 'world'")) << outcome.thrown;
}

TEST(ThreadComm, DifferentReduceOpsAreCaught) {
  const Outcome outcome = run_and_collect(2, [](Communicator& comm) {
    float x[4] = {1, 2, 3, 4};
    comm.all_reduce(x, x, 4, DType::f32, comm.rank() == 0 ? ReduceOp::sum : ReduceOp::max);
  });
  EXPECT_TRUE(contains(outcome.thrown, "different ops (max vs sum)") ||
              contains(outcome.thrown, "different ops (sum vs max)")) << outcome.thrown;
}

TEST(ThreadComm, ReceiveCountMustMatchTheSend) {
  const Outcome outcome = run_and_collect(2, [](Communicator& comm) {
    int32_t buffer[8] = {};
    if (comm.rank() == 0) comm.send(buffer, 8, DType::i32, 1);
    else comm.recv(buffer, 6, DType::i32, 0);
  });
  EXPECT_TRUE(outcome.aborted[1]);
  EXPECT_TRUE(contains(outcome.rank_errors[1], "different counts or dtypes")) << outcome.rank_errors[1];
  EXPECT_TRUE(contains(outcome.rank_errors[1], "(8 x i32)")) << outcome.rank_errors[1];
}

TEST(ThreadComm, AbortReachesEveryRankAndSplitCommunicators) {
  const Outcome outcome = run_and_collect(4, [](Communicator& comm) {
    std::unique_ptr<Communicator> half = comm.split(comm.rank() / 2, comm.rank(), "half");
    if (comm.rank() == 3) {
      half->abort("checkpoint disk full");
      return;
    }
    float x = 1;
    half->all_reduce(&x, &x, 1, DType::f32, ReduceOp::sum);  // ranks 0, 1 may finish this one
    comm.barrier();
  });
  for (int r : {0, 1, 2}) {
    EXPECT_TRUE(outcome.aborted[r]) << r;
    EXPECT_TRUE(contains(outcome.rank_errors[r], "rank 3 aborted the job: checkpoint disk full"))
        << outcome.rank_errors[r];
  }
}

TEST(ThreadComm, InvalidArgumentsLeaveTheCommunicatorUsable) {
  run_thread_comm(2, [](Communicator& comm) {
    float x = 1;
    EXPECT_THROW(comm.broadcast(&x, &x, 1, DType::f32, 2), Error);
    EXPECT_THROW(comm.group_end(), Error);
    EXPECT_THROW(comm.split(-5, 0, "bad"), Error);
    float blocks[2] = {1, 2};  // out on the other rank's block: overlaps the input, not as its own block
    EXPECT_THROW(comm.reduce_scatter(blocks, blocks + (1 - comm.rank()), 1, DType::f32, ReduceOp::sum), Error);
    comm.all_reduce(&x, &x, 1, DType::f32, ReduceOp::sum);
    EXPECT_EQ(x, 2.0f);
    EXPECT_FALSE(comm.aborted());
  });
}

TEST(ThreadComm, SendToItselfNeedsAMatchingReceive) {
  const Outcome outcome = run_and_collect(1, [](Communicator& comm) {
    float x = 1;
    comm.group_start();
    comm.send(&x, 1, DType::f32, 0);
    comm.group_end();
  });
  EXPECT_TRUE(contains(outcome.thrown, "send(s) to itself without a matching recv")) << outcome.thrown;
}

TEST(ThreadComm, NestedGroupsPostAtTheOutermostEnd) {
  run_thread_comm(2, [](Communicator& comm) {
    const int peer = 1 - comm.rank();
    int32_t mine = 10 + comm.rank(), theirs = -1;
    comm.group_start();
    comm.group_start();
    comm.send(&mine, 1, DType::i32, peer);
    comm.group_end();
    EXPECT_EQ(theirs, -1);  // nothing posted yet
    comm.recv(&theirs, 1, DType::i32, peer);
    comm.group_end();
    EXPECT_EQ(theirs, 10 + peer);
  });
}

TEST(ThreadComm, ControlPlaneVoteReportsTheRanksThatSaidNo) {
  std::mutex mutex;
  std::vector<std::string> failures(3);
  run_thread_comm(3, [&](Communicator& comm) {
    const bool ok = comm.rank() != 1;
    const VoteResult vote = comm.control().vote(ok, ok ? "" : "fsync failed on shard 2", "checkpoint 10 commit");
    std::lock_guard<std::mutex> lock(mutex);
    failures[comm.rank()] = vote.all_ok ? "all ok" : vote.failures();
  });
  for (const std::string& text : failures) EXPECT_EQ(text, "rank 1: fsync failed on shard 2");
}

TEST(ThreadComm, SoloCommunicatorDoesEverythingLocally) {
  std::unique_ptr<Communicator> comm = make_solo_comm();
  EXPECT_EQ(comm->size(), 1);
  float in[3] = {1, 2, 3}, out[3] = {};
  comm->all_reduce(in, out, 3, DType::f32, ReduceOp::sum);
  EXPECT_EQ(out[2], 3.0f);
  comm->barrier();
  EXPECT_EQ(comm->control().all_gather("x", "solo")[0], "x");
}

}  // namespace
}  // namespace deltamoe
