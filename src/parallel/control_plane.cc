// ControlPlane::vote on top of all_gather.
#include "parallel/control_plane.h"

#include "core/error.h"

namespace deltamoe {

std::string VoteResult::failures() const {
  std::string text;
  for (size_t r = 0; r < ok.size(); ++r) {
    if (ok[r]) continue;
    if (!text.empty()) text += "; ";
    text += str_cat("rank ", r, ": ", details[r].empty() ? "(no detail)" : details[r]);
  }
  return text;
}

VoteResult ControlPlane::vote(bool ok, std::string_view detail, std::string_view label) {
  std::string mine(1, ok ? '1' : '0');
  mine.append(detail);
  const std::vector<std::string> all = all_gather(mine, label);
  VoteResult result;
  for (size_t r = 0; r < all.size(); ++r) {
    CHECK(!all[r].empty() && (all[r][0] == '0' || all[r][0] == '1'), "vote '", label, "': rank ", r,
          " sent a malformed ballot");
    result.ok.push_back(all[r][0] == '1');
    result.details.push_back(all[r].substr(1));
    result.all_ok = result.all_ok && result.ok.back();
  }
  return result;
}

}  // namespace deltamoe
