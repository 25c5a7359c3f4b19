// TcpComm's rendezvous checks and failure paths, with the ranks as threads of this process:
// duplicate, missing and disagreeing ranks, a foreign client, a port in use, stuck ranks past the
// deadline, ranks calling different operations or control-plane labels, abort, and control-plane
// votes.
#include "parallel/tcp_comm.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "parallel/control_plane.h"
#include "parallel/rendezvous.h"
#include "parallel/tcp_test_util.h"

namespace deltamoe {
namespace {

using Clock = std::chrono::steady_clock;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

CommOptions quick(double timeout = 0.5, double rendezvous = 2) {
  CommOptions options;
  options.timeout_seconds = timeout;
  options.rendezvous_timeout_seconds = rendezvous;
  options.exit_on_abort = false;
  return options;
}

// Starts one rank per env on its own thread; returns each one's error ("" on success).
std::vector<std::string> start_ranks(const std::vector<LaunchEnv>& envs, const CommOptions& options,
                                     const std::function<void(Communicator&)>& fn = {}) {
  std::vector<std::string> errors(envs.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < envs.size(); ++i) {
    threads.emplace_back([&, i] {
      try {
        std::unique_ptr<Communicator> comm = connect_tcp_comm(envs[i], options);
        if (fn) fn(*comm);
      } catch (const std::exception& error) {
        errors[i] = error.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

TEST(TcpRendezvous, DuplicateRankIsRefusedNamingBothProcesses) {
  const int port = free_tcp_port();
  const auto errors = start_ranks({loopback_env(0, 3, port), loopback_env(1, 3, port), loopback_env(1, 3, port)},
                                  quick());
  EXPECT_TRUE(contains(errors[0], "rank 1 came twice")) << errors[0];
  EXPECT_TRUE(contains(errors[0], "the same rank")) << errors[0];
  // The workers fail with rank 0's reason.
  EXPECT_TRUE(contains(errors[1] + errors[2], "rank 0 ended the rendezvous: rank 1 came twice"))
      << errors[1] << " | " << errors[2];
}

TEST(TcpRendezvous, TimeoutNamesTheRanksThatNeverCame) {
  const int port = free_tcp_port();
  const auto start = Clock::now();
  const auto errors = start_ranks({loopback_env(0, 4, port), loopback_env(2, 4, port)}, quick(0.5, 0.5));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0);
  EXPECT_TRUE(contains(errors[0], "got 2 of 4 ranks; ranks 1, 3 never came")) << errors[0];
  EXPECT_TRUE(contains(errors[0], "srun / torchrun / deltamoe launch")) << errors[0];
  EXPECT_TRUE(contains(errors[1], "rank 0 ended the rendezvous")) << errors[1];
  EXPECT_TRUE(contains(errors[1], "ranks 1, 3 never came")) << errors[1];
}

TEST(TcpRendezvous, DisagreeingWorldSizeAndRunIdAreRefused) {
  int port = free_tcp_port();
  auto errors = start_ranks({loopback_env(0, 2, port), loopback_env(1, 3, port)}, quick());
  EXPECT_TRUE(contains(errors[0], "was started for a world of 3 ranks, rank 0 for 2")) << errors[0];
  port = free_tcp_port();
  LaunchEnv other = loopback_env(1, 2, port);
  other.run_id = "another-job";
  errors = start_ranks({loopback_env(0, 2, port), other}, quick());
  EXPECT_TRUE(contains(errors[0], "belongs to run 'another-job'")) << errors[0];
  EXPECT_TRUE(contains(errors[1], "two jobs share the rendezvous address")) << errors[1];
}

TEST(TcpRendezvous, ForeignClientIsIgnored) {
  // Rank 0 waits for rank 1; meanwhile a foreign client connects and sends an HTTP request.
  const int port = free_tcp_port();
  std::string rank0_error;
  std::thread rank0([&] {
    try {
      std::unique_ptr<Communicator> comm = connect_tcp_comm(loopback_env(0, 2, port), quick());
      comm->barrier();
    } catch (const std::exception& error) {
      rank0_error = error.what();
    }
  });
  std::string error;
  Socket stranger = connect_tcp("127.0.0.1", port, deadline_after(2), &error);
  ASSERT_TRUE(stranger.valid()) << error;
  const char junk[] = "GET / HTTP/1.0\r\n\r\n";
  EXPECT_EQ(write_all(stranger.fd(), junk, sizeof(junk), deadline_after(1)), "");
  const auto errors = start_ranks({loopback_env(1, 2, port)}, quick(), [](Communicator& comm) { comm.barrier(); });
  rank0.join();
  EXPECT_EQ(rank0_error, "");
  EXPECT_EQ(errors[0], "");
}

TEST(TcpRendezvous, InheritedListenerIsUsedAndAWrongOneIgnored) {
  std::string error;
  Socket listener = listen_tcp(0, &error);
  const int port = local_port(listener.fd());
  LaunchEnv rank0 = loopback_env(0, 2, port);
  rank0.rendezvous_fd = listener.release();
  auto errors = start_ranks({rank0, loopback_env(1, 2, port)}, quick(), [](Communicator& comm) { comm.barrier(); });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  // Not a listening socket: rank 0 binds the port itself.
  const int other_port = free_tcp_port();
  const int not_a_socket = ::open("/dev/null", O_RDONLY);
  rank0 = loopback_env(0, 2, other_port);
  rank0.rendezvous_fd = not_a_socket;
  errors = start_ranks({rank0, loopback_env(1, 2, other_port)}, quick(), [](Communicator& comm) { comm.barrier(); });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(::close(not_a_socket), 0);  // still open: left alone
}

TEST(TcpRendezvous, PortInUseIsNamed) {
  std::string error;
  Socket holder = listen_tcp(0, &error);
  ASSERT_TRUE(holder.valid()) << error;
  const int port = local_port(holder.fd());
  const auto errors = start_ranks({loopback_env(0, 2, port)}, quick());
  EXPECT_TRUE(contains(errors[0], str_cat("cannot listen on port ", port))) << errors[0];
  EXPECT_TRUE(contains(errors[0], "DELTAMOE_RDZV_PORT")) << errors[0];
}

TEST(TcpRendezvous, UnreachableRankZeroIsNamed) {
  const int port = free_tcp_port();
  const auto errors = start_ranks({loopback_env(1, 2, port)}, quick(0.5, 0.3));
  EXPECT_TRUE(contains(errors[0], str_cat("could not reach rank 0's rendezvous at 127.0.0.1:", port))) << errors[0];
}

TEST(TcpComm, StuckRankIsNamedWithWhatItLastReported) {
  const auto start = Clock::now();
  const auto errors = run_tcp_threads(3, [](Communicator& comm) {
    comm.set_activity(str_cat("step 3 on rank ", comm.rank()));
    if (comm.rank() == 1) {
      while (!comm.aborted()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    float x = 1;
    comm.all_reduce(&x, &x, 1, DType::f32, ReduceOp::sum);
  }, quick(0.5));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_LT(seconds, 4.0);
  // Whoever waited first reports (rank 2 waits for rank 0, which waits for rank 1); rank 0 names
  // the rank outside communication that holds everyone up.
  for (int r : {0, 2}) {
    EXPECT_TRUE(contains(errors[r], "with no data moving, while in all_reduce #1 on 'world'")) << errors[r];
    EXPECT_TRUE(contains(errors[r], "held up by rank 1 (pid")) << errors[r];
    EXPECT_TRUE(contains(errors[r], "which was outside communication")) << errors[r];
    EXPECT_TRUE(contains(errors[r], "label 'step 3 on rank 1'")) << errors[r];
  }
}

TEST(TcpComm, DifferentCollectivesAbortEveryRank) {
  const auto errors = run_tcp_threads(3, [](Communicator& comm) {
    int64_t in[3] = {1, 2, 3}, out[9];
    if (comm.rank() == 2) comm.all_gather(in, out, 3, DType::i64);
    else comm.all_reduce(in, out, 3, DType::i64, ReduceOp::sum);
    comm.barrier();
  }, quick(2));
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(contains(errors[r], "called different operations")) << r << ": " << errors[r];
  }
}

TEST(TcpComm, AbortCarriesTheReasonToEveryRank) {
  const auto errors = run_tcp_threads(4, [](Communicator& comm) {
    if (comm.rank() == 2) {
      comm.abort("out of disk while saving");
      return;
    }
    comm.barrier();
  }, quick(2));
  for (int r : {0, 1, 3}) {
    EXPECT_TRUE(contains(errors[r], "rank 2 aborted the job: out of disk while saving")) << errors[r];
  }
}

TEST(TcpComm, ControlPlaneVoteAndLateRank) {
  std::vector<std::string> failures(3);
  auto errors = run_tcp_threads(3, [&](Communicator& comm) {
    const bool ok = comm.rank() != 2;
    const VoteResult vote = comm.control().vote(ok, ok ? "" : "checksum mismatch", "checkpoint 4 commit");
    failures[comm.rank()] = vote.failures();
  }, quick(2));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[r], "");
    EXPECT_EQ(failures[r], "rank 2: checksum mismatch");
  }
  // A rank that never reaches a control-plane barrier is named after the deadline.
  errors = run_tcp_threads(3, [&](Communicator& comm) {
    comm.set_activity("writing shard");
    if (comm.rank() == 1) {
      while (!comm.aborted()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    comm.control().barrier("checkpoint 4 written");
  }, quick(0.5));
  for (int r : {0, 2}) {
    EXPECT_TRUE(contains(errors[r], "control-plane operation 'checkpoint 4 written' (#1): ranks 1 did not arrive"))
        << errors[r];
    EXPECT_TRUE(contains(errors[r], "label 'writing shard'")) << errors[r];
  }
}

// A control-plane operation that the ranks call under different labels ends the job on every rank,
// whether rank 0 finds the mismatch on a rank's message (the late rank is a worker) or on its own
// arrival (rank 0 is late).
TEST(TcpComm, ControlPlaneLabelsThatDisagreeAbortEveryRank) {
  for (int late : {2, 0}) {
    const auto errors = run_tcp_threads(3, [&](Communicator& comm) {
      if (comm.rank() == late) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      comm.control().barrier(comm.rank() == late ? "save checkpoint 8" : "step 8 done");
    }, quick(2));
    for (int r = 0; r < 3; ++r) {
      EXPECT_TRUE(contains(errors[r], "the ranks run different code paths")) << late << ", " << r << ": " << errors[r];
      EXPECT_TRUE(contains(errors[r], "rank " + std::to_string(late) +
                                          " called control-plane operation 'save checkpoint 8' (#1) while others "
                                          "called 'step 8 done'"))
          << late << ", " << r << ": " << errors[r];
    }
  }
}

TEST(TcpComm, LargeMessagesAndManyRoundsStayExact) {
  const auto errors = run_tcp_threads(3, [](Communicator& comm) {
    const int64_t count = 3 << 20;  // 12 MiB of f32 per rank: several send() calls per message
    std::vector<float> in(count), out(count);
    for (int64_t i = 0; i < count; ++i) in[i] = static_cast<float>((i * 7 + comm.rank()) % 1000);
    comm.all_reduce(in.data(), out.data(), count, DType::f32, ReduceOp::sum);
    for (int64_t i = 0; i < count; i += 4097) {
      float want = 0;
      for (int r = 0; r < 3; ++r) want += static_cast<float>((i * 7 + r) % 1000);
      ASSERT_EQ(out[i], want) << i;
    }
    for (int round = 0; round < 200; ++round) {
      int32_t v = round + comm.rank();
      comm.all_reduce(&v, &v, 1, DType::i32, ReduceOp::max);
      ASSERT_EQ(v, round + 2);
    }
  }, quick(5));
  for (const std::string& e : errors) EXPECT_EQ(e, "");
}

}  // namespace
}  // namespace deltamoe
