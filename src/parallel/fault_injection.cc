// Parsing of DELTAMOE_FAULT and the faults themselves.
#include "parallel/fault_injection.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "core/error.h"
#include "core/log.h"

namespace deltamoe {
namespace {

bool all_digits(std::string_view text) {
  if (text.empty()) return false;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

}  // namespace

std::string_view fault_kind_name(FaultKind kind) {
  switch (kind) {
    case FaultKind::kill: return "kill";
    case FaultKind::exit: return "exit";
    case FaultKind::hang: return "hang";
    case FaultKind::stop: return "stop";
    case FaultKind::term: return "term";
  }
  return "?";
}

FaultPlan FaultPlan::parse(std::string_view text) {
  FaultPlan plan;
  bool have_rank = false;
  bool have_at = false;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string_view::npos) comma = text.size();
    const std::string_view part = text.substr(start, comma - start);
    start = comma + 1;
    if (part.empty()) continue;
    const size_t colon = part.find(':');
    CHECK(colon != std::string_view::npos, "DELTAMOE_FAULT='", text, "': part '", part,
          "' is not key:value (expected rank:R,at:N|LABEL,kind:kill|exit|hang|stop|term)");
    const std::string_view key = part.substr(0, colon);
    const std::string_view value = part.substr(colon + 1);
    if (key == "rank") {
      CHECK(all_digits(value) && value.size() < 9, "DELTAMOE_FAULT='", text, "': rank '", value,
            "' is not a rank number");
      plan.rank = std::atoi(std::string(value).c_str());
      have_rank = true;
    } else if (key == "at") {
      CHECK(!value.empty(), "DELTAMOE_FAULT='", text, "': 'at' is empty");
      if (all_digits(value)) {
        CHECK(value.size() < 18, "DELTAMOE_FAULT='", text, "': operation number '", value, "' is too large");
        plan.at_op = std::strtoull(std::string(value).c_str(), nullptr, 10);
        CHECK(plan.at_op > 0, "DELTAMOE_FAULT='", text, "': operations are numbered from 1");
      } else {
        plan.at_label = std::string(value);
      }
      have_at = true;
    } else if (key == "kind") {
      if (value == "kill") plan.kind = FaultKind::kill;
      else if (value == "exit") plan.kind = FaultKind::exit;
      else if (value == "hang") plan.kind = FaultKind::hang;
      else if (value == "stop") plan.kind = FaultKind::stop;
      else if (value == "term") plan.kind = FaultKind::term;
      else RAISE("DELTAMOE_FAULT='", text, "': kind '", value, "' is not one of kill, exit, hang, stop, term");
    } else {
      RAISE("DELTAMOE_FAULT='", text, "': unknown key '", key, "' (keys: rank, at, kind)");
    }
  }
  CHECK(have_rank, "DELTAMOE_FAULT='", text, "' names no rank (rank:R)");
  CHECK(have_at, "DELTAMOE_FAULT='", text, "' says not when (at:N for the N-th operation or at:LABEL)");
  return plan;
}

std::optional<FaultPlan> FaultPlan::from_env() {
  const char* text = std::getenv("DELTAMOE_FAULT");
  if (text == nullptr || *text == '\0') return std::nullopt;
  return parse(text);
}

std::string FaultPlan::describe() const {
  return str_cat("rank ", rank, " ", fault_kind_name(kind), " at ",
                 at_op ? str_cat("operation #", at_op) : str_cat("label '", at_label, "'"));
}

void inject_fault(const FaultPlan& plan, std::string_view where) {
  log_error("fault injection (DELTAMOE_FAULT): rank ", plan.rank, " ", fault_kind_name(plan.kind), " at ", where);
  switch (plan.kind) {
    case FaultKind::kill: raise(SIGKILL); break;
    case FaultKind::stop: raise(SIGSTOP); break;
    case FaultKind::exit: _exit(3);
    case FaultKind::term: raise(SIGTERM); return;
    case FaultKind::hang: break;
  }
  // hang (and anything that returns from a signal, e.g. SIGCONT after stop): sleep for good.
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

}  // namespace deltamoe
