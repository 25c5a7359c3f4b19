// fork/exec of the ranks, signal forwarding and the wait loop of run_launch.
#include "parallel/launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "parallel/communicator.h"
#include "parallel/launch_env.h"
#include "parallel/socket_util.h"

namespace deltamoe {
namespace {

// Children's pids for the signal handler (async-signal-safe access only).
constexpr int kMaxChildren = 1024;
volatile pid_t g_children[kMaxChildren];
volatile sig_atomic_t g_num_children = 0;
volatile sig_atomic_t g_forwarded_signal = 0;

void forward_signal(int signal) {
  g_forwarded_signal = signal;
  for (int i = 0; i < g_num_children; ++i) {
    if (g_children[i] > 0) ::kill(g_children[i], signal);
  }
}

std::string signal_text(int signal) {
  const char* name = ::strsignal(signal);
  return str_cat("signal ", signal, " (", name ? name : "?", ")");
}

std::string status_text(int status) {
  if (WIFEXITED(status) && WEXITSTATUS(status) == kExitCommAborted) {
    return str_cat("exited with code ", kExitCommAborted, " (its job was aborted)");
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == kExitCommAtFault) {
    return str_cat("exited with code ", kExitCommAtFault, " (named at fault by the job's abort)");
  }
  if (WIFEXITED(status)) return str_cat("exited with code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return str_cat("was killed by ", signal_text(WTERMSIG(status)));
  return "ended";
}

int status_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string default_run_id(const LaunchOptions& o) {
  uint64_t h = 0xcbf29ce484222325ULL;
  auto mix = [&](const std::string& s) {
    for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
    h = (h ^ 0xff) * 0x100000001b3ULL;
  };
  mix(o.master_addr);
  mix(std::to_string(o.master_port));
  mix(std::to_string(o.nnodes));
  mix(std::to_string(o.nproc_per_node));
  for (const std::string& part : o.command) mix(part);
  return str_cat("launch-", std::hex, h);
}

}  // namespace

std::string self_executable() {
  char path[4096];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  CHECK(n > 0, "cannot find the path of this program (/proc/self/exe): ", std::strerror(errno));
  path[n] = '\0';
  return path;
}

LaunchOptions resolve_launch_options(LaunchOptions o) {
  CHECK(o.nproc_per_node >= 1 && o.nproc_per_node <= kMaxChildren, "--nproc_per_node ", o.nproc_per_node,
        " must be between 1 and ", kMaxChildren);
  CHECK(o.nnodes >= 1, "--nnodes ", o.nnodes, " must be at least 1");
  CHECK(o.node_rank >= 0 && o.node_rank < o.nnodes, "--node_rank ", o.node_rank, " must be below --nnodes ", o.nnodes);
  CHECK(!o.command.empty(), "no command to launch");
  CHECK(o.grace_seconds > 0, "the grace period must be positive");
  if (o.master_addr.empty()) {
    CHECK(o.nnodes == 1, "--master_addr (the host of node 0) is required with --nnodes ", o.nnodes);
    o.master_addr = "127.0.0.1";
  }
  if (o.master_port == 0) {
    if (o.nnodes == 1) {
      std::string error;
      Socket listener = listen_tcp(0, &error);
      CHECK(listener.valid(), "cannot open a rendezvous port: ", error);
      o.master_port = local_port(listener.fd());
      o.listener_fd = listener.release();
    } else {
      o.master_port = 29500;
    }
  }
  CHECK(o.master_port > 0 && o.master_port <= 65535, "--master_port ", o.master_port, " is not a TCP port");
  return o;
}

std::map<std::string, std::string> child_environment(const std::map<std::string, std::string>& base,
                                                     const LaunchOptions& o, int local_rank,
                                                     const std::string& run_id) {
  std::map<std::string, std::string> env = base;
  for (const char* name : {"NPROC_PER_NODE", "NNODES", "NODE_RANK", "TORCHELASTIC_USE_AGENT_STORE",
                           "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"}) {
    env.erase(name);
  }
  env["RANK"] = std::to_string(o.node_rank * o.nproc_per_node + local_rank);
  env["WORLD_SIZE"] = std::to_string(o.nnodes * o.nproc_per_node);
  env["LOCAL_RANK"] = std::to_string(local_rank);
  env["LOCAL_WORLD_SIZE"] = std::to_string(o.nproc_per_node);
  env["GROUP_RANK"] = std::to_string(o.node_rank);
  env["GROUP_WORLD_SIZE"] = std::to_string(o.nnodes);
  env["MASTER_ADDR"] = o.master_addr;
  env["MASTER_PORT"] = std::to_string(o.master_port);
  env["DELTAMOE_RUN_ID"] = run_id;
  return env;
}

int run_launch(const LaunchOptions& given) {
  const LaunchOptions o = resolve_launch_options(given);
  Socket listener(o.listener_fd);  // closed once the ranks are started (rank 0 holds its own copy)
  const std::map<std::string, std::string> base = process_env();
  const std::string run_id = base.count("DELTAMOE_RUN_ID") ? base.at("DELTAMOE_RUN_ID") : default_run_id(o);
  const int n = o.nproc_per_node;

  // Everything the children need is built before fork: only async-signal-safe calls after it.
  std::vector<std::vector<std::string>> env_strings(n);
  std::vector<std::vector<char*>> envps(n);
  for (int i = 0; i < n; ++i) {
    std::map<std::string, std::string> env = child_environment(base, o, i, run_id);
    env.erase("DELTAMOE_RDZV_FD");
    if (listener.valid() && i == 0 && o.node_rank == 0) env["DELTAMOE_RDZV_FD"] = std::to_string(listener.fd());
    for (const auto& [key, value] : env) env_strings[i].push_back(key + "=" + value);
    for (std::string& s : env_strings[i]) envps[i].push_back(s.data());
    envps[i].push_back(nullptr);
  }
  std::vector<std::string> argv_strings = o.command;
  std::vector<char*> argv;
  for (std::string& s : argv_strings) argv.push_back(s.data());
  argv.push_back(nullptr);

  struct sigaction forward {}, previous[3];
  forward.sa_handler = forward_signal;
  sigemptyset(&forward.sa_mask);
  const int forwarded[3] = {SIGINT, SIGTERM, SIGHUP};
  for (int i = 0; i < 3; ++i) ::sigaction(forwarded[i], &forward, &previous[i]);
  g_forwarded_signal = 0;
  g_num_children = 0;

  log_info("launch: ", n, " ranks on node ", o.node_rank, " of ", o.nnodes, " (world ", n * o.nnodes,
           "), rendezvous ", o.master_addr, ":", o.master_port, ", run ", run_id);
  const pid_t launcher_pid = ::getpid();
  std::vector<pid_t> pids(n, -1);
  // Signals stay blocked across fork so a child never runs the launcher's handler; it restores
  // the default actions before unblocking them.
  sigset_t block, old_mask;
  sigemptyset(&block);
  for (int s : forwarded) sigaddset(&block, s);
  ::sigprocmask(SIG_BLOCK, &block, &old_mask);
  for (int i = 0; i < n; ++i) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      // Own process group: a terminal's Ctrl-C reaches the launcher only, which forwards it once.
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // the ranks die with the launcher
      if (::getppid() != launcher_pid) _exit(127);
      struct sigaction default_action {};
      default_action.sa_handler = SIG_DFL;
      for (int s : forwarded) ::sigaction(s, &default_action, nullptr);
      ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
      // Rank 0 keeps the rendezvous listener across exec; the others do not see it (CLOEXEC).
      if (i == 0 && listener.valid()) ::fcntl(listener.fd(), F_SETFD, 0);
      ::execve(argv[0], argv.data(), envps[i].data());
      const char* message = "launch: exec failed\n";
      [[maybe_unused]] ssize_t w = ::write(2, message, std::strlen(message));
      _exit(127);
    }
    if (pid < 0) {
      const std::string reason = std::strerror(errno);
      ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
      forward_signal(SIGKILL);
      for (int j = 0; j < i; ++j) ::waitpid(pids[j], nullptr, 0);
      for (int k = 0; k < 3; ++k) ::sigaction(forwarded[k], &previous[k], nullptr);
      RAISE("launch: cannot start rank ", o.node_rank * n + i, ": fork failed: ", reason);
    }
    pids[i] = pid;
    g_children[i] = pid;
    g_num_children = i + 1;
  }
  ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  listener.reset();

  std::vector<int> statuses(n, 0);
  std::vector<bool> done(n, false);
  int remaining = n;
  int first_failed = -1;   // local index of the first rank to fail
  int root_cause = -1;     // first failure that is not a follower's kExitCommAborted
  auto failed_at = SteadyClock::now();
  int escalation = 0;  // 0 none, 1 SIGTERM sent, 2 SIGKILL sent
  auto escalated_at = SteadyClock::now();
  while (remaining > 0) {
    int status = 0;
    // Block until the first failure (so the first to die is reaped first); then poll, to escalate.
    const pid_t pid = ::waitpid(-1, &status, first_failed < 0 ? 0 : WNOHANG);
    if (pid < 0 && errno == EINTR) continue;
    if (pid < 0) break;  // no children left
    if (pid > 0) {
      int i = 0;
      while (i < n && pids[i] != pid) ++i;
      if (i == n || done[i]) continue;
      done[i] = true;
      g_children[i] = -1;
      statuses[i] = status;
      --remaining;
      const int rank = o.node_rank * n + i;
      const bool failed = status_code(status) != 0;
      if (failed && first_failed < 0) {
        first_failed = i;
        failed_at = SteadyClock::now();
        log_error("launch: rank ", rank, " (pid ", pid, ") ", status_text(status), "; the other ranks get ",
                  o.grace_seconds, " s to stop by themselves");
      }
      if (failed && root_cause < 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == kExitCommAborted)) root_cause = i;
      continue;
    }
    const double since_failure = std::chrono::duration<double>(SteadyClock::now() - failed_at).count();
    const double since_escalation = std::chrono::duration<double>(SteadyClock::now() - escalated_at).count();
    if (escalation == 0 && since_failure > o.grace_seconds) {
      std::string alive;
      for (int i = 0; i < n; ++i) {
        if (!done[i]) alive += str_cat(alive.empty() ? "" : ", ", o.node_rank * n + i);
      }
      log_error("launch: stopping ranks ", alive, " (SIGTERM)");
      forward_signal(SIGTERM);
      forward_signal(SIGCONT);  // a stopped rank must run to receive it
      escalation = 1;
      escalated_at = SteadyClock::now();
    } else if (escalation == 1 && since_escalation > o.grace_seconds) {
      log_error("launch: killing the ranks still running (SIGKILL)");
      forward_signal(SIGKILL);
      escalation = 2;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (int k = 0; k < 3; ++k) ::sigaction(forwarded[k], &previous[k], nullptr);
  g_num_children = 0;
  if (first_failed < 0) return 0;
  if (root_cause < 0) root_cause = first_failed;
  std::string all;
  for (int i = 0; i < n; ++i) all += str_cat(i ? "; " : "", "rank ", o.node_rank * n + i, " ", status_text(statuses[i]));
  // `train` stopped by SIGTERM / SIGINT / SIGHUP on every rank (they agree on the step and save
  // together) exits with 128 + the signal: a stop, not a failure.
  bool stopped = true;
  for (int i = 0; i < n; ++i) {
    const int code = WIFEXITED(statuses[i]) ? WEXITSTATUS(statuses[i]) : -1;
    stopped = stopped && code == WEXITSTATUS(statuses[0]) &&
              (code == 128 + SIGTERM || code == 128 + SIGINT || code == 128 + SIGHUP);
  }
  if (stopped) {
    log_warn("launch: every rank stopped on signal ", WEXITSTATUS(statuses[0]) - 128, " (exit code ",
             WEXITSTATUS(statuses[0]), "). Ranks: ", all);
    return WEXITSTATUS(statuses[0]);
  }
  log_error("launch: the job failed because of rank ", o.node_rank * n + root_cause, ", which ",
            status_text(statuses[root_cause]), ". Ranks: ", all);
  return status_code(statuses[root_cause]);
}

}  // namespace deltamoe
