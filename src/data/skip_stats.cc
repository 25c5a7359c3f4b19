// Skip reasons' names and the skip counters.
#include "data/skip_stats.h"

#include "core/log.h"

namespace deltamoe {

const char* skip_reason_name(SkipReason reason) {
  switch (reason) {
    case SkipReason::kMalformedJson: return "malformed_json";
    case SkipReason::kBadConversation: return "bad_conversation";
    case SkipReason::kMissingImage: return "missing_image";
    case SkipReason::kBadImage: return "bad_image";
    case SkipReason::kUnsupported: return "unsupported";
    case SkipReason::kNoSupervisedToken: return "no_supervised_token";
    case SkipReason::kTooLong: return "too_long";
    case SkipReason::kCount: break;
  }
  return "unknown";
}

void SkipStats::add(SkipReason reason, const std::string& message, const std::string& detail) {
  ++counts_[static_cast<size_t>(reason)];
  if (!detail.empty()) ++details_[static_cast<size_t>(reason)][detail];
  if (messages_.size() >= num_messages_kept_) return;
  messages_.push_back(str_cat(skip_reason_name(reason), ": ", message));
  if (log_) {
    log_warn("skipping sample (", messages_.back(), ")",
             messages_.size() == num_messages_kept_ ? "; further skips are only counted" : "");
  }
}

int64_t SkipStats::count_detail(const std::string& detail) const {
  int64_t sum = 0;
  for (const auto& details : details_) {
    auto it = details.find(detail);
    if (it != details.end()) sum += it->second;
  }
  return sum;
}

int64_t SkipStats::total() const {
  int64_t sum = 0;
  for (const int64_t count : counts_) sum += count;
  return sum;
}

std::string SkipStats::summary() const {
  std::string out = str_cat(total(), " skipped");
  std::string parts;
  for (size_t i = 0; i < counts_.size(); ++i) {
    if (counts_[i] == 0) continue;
    parts += str_cat(parts.empty() ? "" : ", ", skip_reason_name(static_cast<SkipReason>(i)), " ", counts_[i]);
    std::string details;
    for (const auto& [detail, count] : details_[i]) details += str_cat(details.empty() ? "" : ", ", detail, " ", count);
    if (!details.empty()) parts += " [" + details + "]";
  }
  if (!parts.empty()) out += " (" + parts + ")";
  if (num_truncated_ > 0) out += str_cat(", ", num_truncated_, " truncated");
  return out;
}

}  // namespace deltamoe
