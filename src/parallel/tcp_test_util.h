// Test helper: runs N TcpComm ranks as threads of the test process over loopback sockets (real
// rendezvous, control plane and data connections; exit_on_abort off). Header-only, tests only.
#pragma once

#include <exception>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "parallel/socket_util.h"
#include "parallel/tcp_comm.h"

namespace deltamoe {

// A port that was free a moment ago (the rendezvous binds it again), drawn below Linux's ephemeral
// range (32768+) so that outgoing connections of other tests cannot take it in between.
inline int free_tcp_port() {
  static std::mt19937 random(std::random_device{}());
  std::uniform_int_distribution<int> pick(20000, 32000);
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = pick(random);
    std::string error;
    Socket socket = listen_tcp(port, &error);
    if (socket.valid()) return port;
  }
  return 0;
}

inline LaunchEnv loopback_env(int rank, int world, int port) {
  LaunchEnv env;
  env.launcher = Launcher::torchrun;
  env.rank = rank;
  env.world_size = world;
  env.local_rank = rank;
  env.local_world_size = world;
  env.master_addr = "127.0.0.1";
  env.rendezvous_port = port;
  env.run_id = "tcp-test";
  return env;
}

// Each rank's exception message ("" when it returned normally).
inline std::vector<std::string> run_tcp_threads(int world, const std::function<void(Communicator&)>& fn,
                                                CommOptions options = {}) {
  options.exit_on_abort = false;
  // Rank 0 gets the listener ready-made, as `deltamoe launch` hands it over.
  std::string listen_error;
  Socket listener = listen_tcp(0, &listen_error);
  const int port = local_port(listener.fd());
  const int listener_fd = listener.release();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        LaunchEnv env = loopback_env(r, world, port);
        if (r == 0) env.rendezvous_fd = listener_fd;
        std::unique_ptr<Communicator> comm = connect_tcp_comm(env, options);
        try {
          fn(*comm);
        } catch (const CommAborted&) {
          throw;
        } catch (const std::exception& error) {
          comm->abort(str_cat("rank ", r, " failed: ", error.what()));
          throw;
        }
      } catch (const std::exception& error) {
        errors[r] = error.what();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  return errors;
}

}  // namespace deltamoe
