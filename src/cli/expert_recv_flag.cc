// Declaration and reading of --expert_recv_headroom (see the header).
#include "cli/expert_recv_flag.h"

#include <cmath>
#include <cstdlib>

#include "core/error.h"

namespace deltamoe {

void declare_expert_recv_headroom_flag(ArgParser& args, const char* default_value) {
  args.add_option("expert_recv_headroom",
                  "expert parallelism: rows a rank's experts may receive per layer, over the mean (tokens x top-k); "
                  "at least 1, at most the expert-parallel size (every token routed to one rank). auto: 1.25 and "
                  "as much more as the GPU memory left by the plan holds. A micro-batch needing more stops the run "
                  "with a message; --resume auto continues it",
                  default_value);
}

double parse_expert_recv_headroom(const std::string& text) {
  if (text == "auto") return 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  CHECK(!text.empty() && end != nullptr && *end == '\0' && std::isfinite(value) && value >= 1,
        "--expert_recv_headroom must be auto or a number of at least 1, got '", text, "'");
  return value;
}

}  // namespace deltamoe
