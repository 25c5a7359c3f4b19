// Launcher variables -> LaunchEnv: one candidate per launcher found, the first in precedence order
// wins (torchrun > Open MPI > MPICH > Slurm), the others must agree with it when they describe the
// same number of processes and are reported as an outer launch otherwise.
#include "parallel/launch_env.h"

#include <cstdlib>
#include <optional>

#include "core/error.h"

extern char** environ;

namespace deltamoe {
namespace {

std::optional<std::string> lookup(const EnvMap& env, const std::string& name) {
  auto it = env.find(name);
  if (it == env.end()) return std::nullopt;
  return it->second;
}

int parse_int(const std::string& name, const std::string& text, int min_value, std::string_view what) {
  CHECK(!text.empty(), name, " is set but empty; it must be ", what);
  size_t i = 0;
  bool negative = false;
  if (text[0] == '-' || text[0] == '+') {
    negative = text[0] == '-';
    i = 1;
  }
  CHECK(i < text.size() && text.size() - i <= 9, name, "='", text, "' is not ", what);
  long value = 0;
  for (; i < text.size(); ++i) {
    CHECK(text[i] >= '0' && text[i] <= '9', name, "='", text, "' is not ", what);
    value = value * 10 + (text[i] - '0');
  }
  if (negative) value = -value;
  CHECK(value >= min_value, name, "=", text, " is not ", what);
  return static_cast<int>(value);
}

std::optional<int> int_var(const EnvMap& env, const std::string& name, int min_value, std::string_view what) {
  const auto text = lookup(env, name);
  if (!text) return std::nullopt;
  return parse_int(name, *text, min_value, what);
}

// What one launcher's variables say.
struct Candidate {
  Launcher launcher = Launcher::none;
  int rank = 0;
  int world = 1;
  int local_rank = -1;  // -1: not given
  int local_world = -1;
  int node = -1;
  std::string rank_var, world_var, local_rank_var;
  std::string origin;
};

void validate(const Candidate& c) {
  CHECK(c.rank < c.world, c.rank_var, "=", c.rank, " is not below ", c.world_var, "=", c.world,
        " (ranks are 0 .. world size - 1)");
  if (c.local_world >= 0) {
    CHECK(c.local_world <= c.world, "the local world size ", c.local_world, " (", launcher_name(c.launcher),
          ") is larger than ", c.world_var, "=", c.world);
  }
  if (c.local_rank >= 0 && c.local_world >= 0) {
    CHECK(c.local_rank < c.local_world, c.local_rank_var, "=", c.local_rank,
          " is not below the local world size ", c.local_world, " (", launcher_name(c.launcher), ")");
  }
}

// Both-or-neither pairs: RANK with WORLD_SIZE, etc.
bool pair_present(const EnvMap& env, const std::string& a, const std::string& b, std::string_view launcher) {
  const bool has_a = env.count(a) > 0;
  const bool has_b = env.count(b) > 0;
  CHECK(has_a == has_b, (has_a ? a : b), " is set but ", (has_a ? b : a), " is not; ", launcher,
        " sets both");
  return has_a;
}

// The variables of a launcher that sets its rank and world size as a pair (slurm's world size has
// alternatives and is read apart); node may be null.
struct PairLauncher {
  Launcher launcher;
  const char* rank;
  const char* world;
  const char* local_rank;
  const char* local_world;
  const char* node;
  const char* sets_both;  // who sets the pair, for the message when one is missing
};

constexpr PairLauncher kTorchrun{Launcher::torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                 "GROUP_RANK", "torchrun (and deltamoe launch)"};
constexpr PairLauncher kOpenMpi{Launcher::open_mpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
                                "OMPI_COMM_WORLD_NODE_RANK", "Open MPI's mpirun"};
constexpr PairLauncher kMpich{Launcher::mpich, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                              nullptr, "MPICH's Hydra (mpiexec)"};

std::optional<Candidate> pair_candidate(const EnvMap& env, const PairLauncher& vars) {
  if (!pair_present(env, vars.rank, vars.world, vars.sets_both)) return std::nullopt;
  Candidate c;
  c.launcher = vars.launcher;
  c.rank_var = vars.rank;
  c.world_var = vars.world;
  c.local_rank_var = vars.local_rank;
  c.world = *int_var(env, vars.world, 1, "a world size (an integer >= 1)");
  c.rank = *int_var(env, vars.rank, 0, "a rank (an integer >= 0)");
  c.local_rank = int_var(env, vars.local_rank, 0, "a local rank (an integer >= 0)").value_or(-1);
  c.local_world = int_var(env, vars.local_world, 1, "a local world size (an integer >= 1)").value_or(-1);
  if (vars.node != nullptr) c.node = int_var(env, vars.node, 0, "a node rank (an integer >= 0)").value_or(-1);
  c.origin = str_cat(vars.rank, "=", c.rank, " ", vars.world, "=", c.world);
  if (c.local_rank >= 0) c.origin += str_cat(" ", vars.local_rank, "=", c.local_rank);
  if (c.local_world >= 0) c.origin += str_cat(" ", vars.local_world, "=", c.local_world);
  if (c.node >= 0) c.origin += str_cat(" ", vars.node, "=", c.node);
  return c;
}

std::optional<Candidate> slurm_candidate(const EnvMap& env) {
  if (!env.count("SLURM_PROCID")) return std::nullopt;
  Candidate c;
  c.launcher = Launcher::slurm;
  c.rank_var = "SLURM_PROCID";
  c.local_rank_var = "SLURM_LOCALID";
  c.rank = *int_var(env, "SLURM_PROCID", 0, "a rank (an integer >= 0)");
  if (env.count("SLURM_STEP_NUM_TASKS")) c.world_var = "SLURM_STEP_NUM_TASKS";
  else if (env.count("SLURM_NTASKS")) c.world_var = "SLURM_NTASKS";
  else RAISE("SLURM_PROCID is set but neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is: cannot tell the world size");
  c.world = *int_var(env, c.world_var, 1, "a task count (an integer >= 1)");
  c.local_rank = int_var(env, "SLURM_LOCALID", 0, "a local rank (an integer >= 0)").value_or(-1);
  c.node = int_var(env, "SLURM_NODEID", 0, "a node index (an integer >= 0)").value_or(-1);
  for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    const auto text = lookup(env, name);
    if (!text) continue;
    std::vector<int> per_node;
    try {
      per_node = expand_tasks_per_node(*text);
    } catch (const Error& error) {
      RAISE(name, "='", *text, "': ", error.what());
    }
    const int node = c.node >= 0 ? c.node : 0;
    CHECK(node < static_cast<int>(per_node.size()), name, "='", *text, "' lists ", per_node.size(),
          " nodes but SLURM_NODEID=", node);
    c.local_world = per_node[node];
    break;
  }
  c.origin = str_cat("SLURM_PROCID=", c.rank, " ", c.world_var, "=", c.world);
  if (c.local_rank >= 0) c.origin += str_cat(" SLURM_LOCALID=", c.local_rank);
  if (c.node >= 0) c.origin += str_cat(" SLURM_NODEID=", c.node);
  return c;
}

bool truthy(const std::optional<std::string>& text) {
  return text && (*text == "True" || *text == "true" || *text == "1");
}

int parse_port(const std::string& name, const std::string& text) {
  const int port = parse_int(name, text, 1, "a TCP port (1..65535)");
  CHECK(port <= 65535, name, "=", text, " is not a TCP port (1..65535)");
  return port;
}

void choose_rendezvous(const EnvMap& env, const Candidate& chosen, LaunchEnv& out) {
  const auto master_addr = lookup(env, "MASTER_ADDR");
  const auto master_port = lookup(env, "MASTER_PORT");
  const auto our_port = lookup(env, "DELTAMOE_RDZV_PORT");
  const bool agent_store = chosen.launcher == Launcher::torchrun && truthy(lookup(env, "TORCHELASTIC_USE_AGENT_STORE"));
  if (master_addr) {
    CHECK(!master_addr->empty(), "MASTER_ADDR is set but empty; it must name the host of rank 0");
    out.master_addr = *master_addr;
    out.rendezvous_origin = str_cat("MASTER_ADDR=", *master_addr);
  } else if (chosen.launcher == Launcher::slurm) {
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
      const auto list = lookup(env, name);
      if (!list) continue;
      std::vector<std::string> hosts;
      try {
        hosts = expand_hostlist(*list);
      } catch (const Error& error) {
        RAISE(name, "='", *list, "': ", error.what());
      }
      CHECK(!hosts.empty(), name, " is empty");
      out.master_addr = hosts[0];
      out.rendezvous_origin = str_cat("first host of ", name, " (", hosts[0], ")");
      break;
    }
  }
  std::string port_origin;
  if (our_port) {
    out.rendezvous_port = parse_port("DELTAMOE_RDZV_PORT", *our_port);
    port_origin = str_cat("DELTAMOE_RDZV_PORT=", out.rendezvous_port);
  } else if (master_port) {
    const int port = parse_port("MASTER_PORT", *master_port);
    if (agent_store) {
      CHECK(port < 65535, "MASTER_PORT=", port, " is torchrun's agent store and MASTER_PORT+1 is no port: set ",
            "DELTAMOE_RDZV_PORT");
      out.rendezvous_port = port + 1;
      port_origin = str_cat("MASTER_PORT+1=", port + 1, " (torchrun's agent store holds MASTER_PORT=", port,
                            "; DELTAMOE_RDZV_PORT overrides)");
    } else {
      out.rendezvous_port = port;
      port_origin = str_cat("MASTER_PORT=", port);
    }
  } else if (chosen.launcher == Launcher::slurm && env.count("SLURM_JOB_ID")) {
    const int job = parse_int("SLURM_JOB_ID", *lookup(env, "SLURM_JOB_ID"), 0, "a job id (an integer >= 0)");
    out.rendezvous_port = 20000 + job % 20000;
    port_origin = str_cat("20000 + SLURM_JOB_ID % 20000 = ", out.rendezvous_port);
  }
  if (!port_origin.empty()) {
    out.rendezvous_origin += (out.rendezvous_origin.empty() ? "" : ", port ") + port_origin;
  }
  if (chosen.launcher == Launcher::torchrun && chosen.world > 1) {
    CHECK(!out.master_addr.empty(), "RANK/WORLD_SIZE are set (world of ", chosen.world,
          ") but MASTER_ADDR is not; torchrun and deltamoe launch set it to the host of rank 0");
    CHECK(out.rendezvous_port != 0, "RANK/WORLD_SIZE are set (world of ", chosen.world,
          ") but neither MASTER_PORT nor DELTAMOE_RDZV_PORT is");
  }
}

std::string choose_run_id(const EnvMap& env) {
  for (const char* name : {"DELTAMOE_RUN_ID", "TORCHELASTIC_RUN_ID"}) {
    const auto id = lookup(env, name);
    if (id && !id->empty()) return *id;
  }
  const auto job = lookup(env, "SLURM_JOB_ID");
  if (job) return str_cat("slurm-", *job, ".", lookup(env, "SLURM_STEP_ID").value_or(""));
  return "";
}

}  // namespace

std::string_view launcher_name(Launcher launcher) {
  switch (launcher) {
    case Launcher::none: return "none";
    case Launcher::torchrun: return "torchrun/deltamoe launch";
    case Launcher::open_mpi: return "Open MPI";
    case Launcher::mpich: return "MPICH/Hydra";
    case Launcher::slurm: return "srun";
  }
  return "?";
}

std::string LaunchEnv::describe() const {
  if (launcher == Launcher::none) return "rank 0 of 1 (no launcher variables)";
  std::string text = str_cat("rank ", rank, " of ", world_size, " (local ", local_rank, " of ", local_world_size);
  if (node_rank >= 0) text += str_cat(", node ", node_rank);
  text += str_cat(") from ", launcher_name(launcher), ": ", origin);
  if (!rendezvous_origin.empty()) text += str_cat("; rendezvous ", master_addr, ":", rendezvous_port, " from ", rendezvous_origin);
  for (const std::string& note : notes) text += str_cat("; ", note);
  return text;
}

LaunchEnv read_launch_env(const EnvMap& env) {
  std::vector<Candidate> candidates;
  // In precedence order, each read and checked before the next is read.
  auto add = [&](std::optional<Candidate> c) {
    if (!c) return;
    validate(*c);
    candidates.push_back(std::move(*c));
  };
  for (const PairLauncher* vars : {&kTorchrun, &kOpenMpi, &kMpich}) add(pair_candidate(env, *vars));
  add(slurm_candidate(env));
  LaunchEnv out;
  out.run_id = choose_run_id(env);
  if (candidates.empty()) return out;
  const Candidate& chosen = candidates[0];
  for (size_t i = 1; i < candidates.size(); ++i) {
    const Candidate& other = candidates[i];
    if (other.world != chosen.world) {
      out.notes.push_back(str_cat(launcher_name(other.launcher), "'s ", other.rank_var, "/", other.world_var,
                                  " (world of ", other.world, ") describe an outer launch and are ignored"));
      continue;
    }
    CHECK(other.rank == chosen.rank, chosen.rank_var, "=", chosen.rank, " (", launcher_name(chosen.launcher),
          ") and ", other.rank_var, "=", other.rank, " (", launcher_name(other.launcher), ") disagree although ",
          chosen.world_var, " and ", other.world_var, " both give ", chosen.world,
          " processes; unset the variables of the launcher that did not start this process");
    if (chosen.local_rank >= 0 && other.local_rank >= 0) {
      CHECK(other.local_rank == chosen.local_rank, chosen.local_rank_var, "=", chosen.local_rank, " (",
            launcher_name(chosen.launcher), ") and ", other.local_rank_var, "=", other.local_rank, " (",
            launcher_name(other.launcher), ") disagree; unset the variables of the launcher that did not start "
            "this process");
    }
  }
  out.launcher = chosen.launcher;
  out.rank = chosen.rank;
  out.world_size = chosen.world;
  out.node_rank = chosen.node;
  out.origin = chosen.origin;
  // Without local variables the job is taken to run on one node.
  out.local_rank = chosen.local_rank >= 0 ? chosen.local_rank : chosen.rank;
  out.local_world_size = chosen.local_world >= 0 ? chosen.local_world : chosen.world;
  if (out.local_rank >= out.local_world_size) {
    RAISE(chosen.local_rank_var, "=", out.local_rank, " is not below the local world size ", out.local_world_size);
  }
  choose_rendezvous(env, chosen, out);
  if (const auto fd = lookup(env, "DELTAMOE_RDZV_FD"); fd && out.rank == 0) {
    out.rendezvous_fd = parse_int("DELTAMOE_RDZV_FD", *fd, 0, "a file descriptor (an integer >= 0)");
  }
  return out;
}

EnvMap process_env() {
  EnvMap env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text(*entry);
    const size_t equals = text.find('=');
    if (equals == std::string::npos) continue;
    env[text.substr(0, equals)] = text.substr(equals + 1);
  }
  return env;
}

LaunchEnv read_launch_env() { return read_launch_env(process_env()); }

namespace {

// Splits at commas outside brackets.
std::vector<std::string_view> split_top_level(std::string_view text) {
  std::vector<std::string_view> parts;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '[') ++depth;
    else if (text[i] == ']') --depth;
    CHECK(depth >= 0 && depth <= 1, "unbalanced brackets in host list '", text, "'");
    if (text[i] == ',' && depth == 0) {
      parts.push_back(text.substr(start, i - start));
      start = i + 1;
    }
  }
  CHECK(depth == 0, "unbalanced brackets in host list '", text, "'");
  parts.push_back(text.substr(start));
  return parts;
}

long parse_index(std::string_view digits, std::string_view context) {
  CHECK(!digits.empty() && digits.size() <= 9, "bad number '", digits, "' in host list '", context, "'");
  long value = 0;
  for (char c : digits) {
    CHECK(c >= '0' && c <= '9', "bad number '", digits, "' in host list '", context, "'");
    value = value * 10 + (c - '0');
  }
  return value;
}

void expand_entry(std::string_view entry, std::string_view context, std::vector<std::string>& out) {
  const size_t open = entry.find('[');
  if (open == std::string_view::npos) {
    CHECK(!entry.empty(), "empty host name in host list '", context, "'");
    out.emplace_back(entry);
    return;
  }
  const size_t close = entry.find(']', open);
  CHECK(close != std::string_view::npos, "unbalanced brackets in host list '", context, "'");
  const std::string_view prefix = entry.substr(0, open);
  const std::string_view ranges = entry.substr(open + 1, close - open - 1);
  const std::string_view suffix = entry.substr(close + 1);
  CHECK(!ranges.empty(), "empty brackets in host list '", context, "'");
  size_t start = 0;
  while (start <= ranges.size()) {
    size_t comma = ranges.find(',', start);
    if (comma == std::string_view::npos) comma = ranges.size();
    const std::string_view range = ranges.substr(start, comma - start);
    start = comma + 1;
    const size_t dash = range.find('-');
    const std::string_view low_text = range.substr(0, dash);
    const std::string_view high_text = dash == std::string_view::npos ? low_text : range.substr(dash + 1);
    const long low = parse_index(low_text, context);
    const long high = parse_index(high_text, context);
    CHECK(low <= high, "range ", range, " runs backwards in host list '", context, "'");
    CHECK(high - low < 100000, "range ", range, " is too long in host list '", context, "'");
    for (long i = low; i <= high; ++i) {
      std::string number = std::to_string(i);
      if (number.size() < low_text.size()) number.insert(0, low_text.size() - number.size(), '0');
      // The suffix may hold further bracket groups.
      expand_entry(str_cat(prefix, number, suffix), context, out);
    }
  }
}

}  // namespace

std::vector<std::string> expand_hostlist(std::string_view list) {
  std::vector<std::string> hosts;
  for (std::string_view entry : split_top_level(list)) expand_entry(entry, list, hosts);
  return hosts;
}

std::vector<int> expand_tasks_per_node(std::string_view text) {
  std::vector<int> counts;
  size_t start = 0;
  CHECK(!text.empty(), "empty task list");
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string_view::npos) comma = text.size();
    const std::string_view part = text.substr(start, comma - start);
    start = comma + 1;
    const size_t paren = part.find("(x");
    const std::string_view count_text = part.substr(0, paren);
    int repeat = 1;
    if (paren != std::string_view::npos) {
      CHECK(part.back() == ')', "bad entry '", part, "' (expected N or N(xM))");
      repeat = static_cast<int>(parse_index(part.substr(paren + 2, part.size() - paren - 3), text));
    }
    const int count = static_cast<int>(parse_index(count_text, text));
    CHECK(repeat >= 1 && repeat <= 100000, "bad repeat in '", part, "'");
    counts.insert(counts.end(), repeat, count);
  }
  return counts;
}

}  // namespace deltamoe
