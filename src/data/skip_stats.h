// Counts of skipped, dropped and truncated samples by reason, plus the first few messages, so a
// data problem is always visible in the run's output and never a silent loss.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "data/sample_skip.h"

namespace deltamoe {

class SkipStats {
 public:
  explicit SkipStats(size_t num_messages_kept = 8, bool log_as_they_come = true)
      : num_messages_kept_(num_messages_kept), log_(log_as_they_come) {}

  // Counts one skip (and its detail, the form within the reason: "video", "remote_image", ...); the
  // first num_messages_kept messages are kept (and logged as warnings).
  void add(SkipReason reason, const std::string& message, const std::string& detail = "");
  void add_truncated() { ++num_truncated_; }

  int64_t count(SkipReason reason) const { return counts_[static_cast<size_t>(reason)]; }
  // Skips of one detail ("video", ...) within any reason.
  int64_t count_detail(const std::string& detail) const;
  int64_t total() const;
  int64_t num_truncated() const { return num_truncated_; }
  const std::vector<std::string>& first_messages() const { return messages_; }
  // "3 skipped (malformed_json 1, missing_image 2)" or "0 skipped"; a reason with details lists them:
  // "unsupported 3 [video 2, audio 1]".
  std::string summary() const;

 private:
  size_t num_messages_kept_;
  bool log_;
  std::array<int64_t, static_cast<size_t>(SkipReason::kCount)> counts_{};
  std::array<std::map<std::string, int64_t>, static_cast<size_t>(SkipReason::kCount)> details_;
  int64_t num_truncated_ = 0;
  std::vector<std::string> messages_;
};

}  // namespace deltamoe
