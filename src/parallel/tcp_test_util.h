// Test helper: runs N TcpComm ranks as threads of the test process over loopback sockets (real
// rendezvous, control plane and data connections; exit_on_abort off). Header-only, tests only.
#pragma once

#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "parallel/socket_util.h"
#include "parallel/tcp_comm.h"

namespace deltamoe {

// A port that was free a moment ago (the rendezvous binds it again).
inline int free_tcp_port() {
  std::string error;
  Socket socket = listen_tcp(0, &error);
  return socket.valid() ? local_port(socket.fd()) : 0;
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
  const int port = free_tcp_port();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::unique_ptr<Communicator> comm = connect_tcp_comm(loopback_env(r, world, port), options);
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
