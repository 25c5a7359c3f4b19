// Why a dataset sample is left out of training, and the exception that carries the reason from
// the code that notices the problem (parsing, images, labels) to the pipeline that counts it.
#pragma once

#include <string>

#include "core/error.h"

namespace deltamoe {

enum class SkipReason : int {
  kMalformedJson,     // the line is not a JSON object
  kBadConversation,   // JSON is fine but the messages cannot be rendered (roles, fields, <image> count)
  kMissingImage,      // an image file that does not exist or cannot be read, or a URL
  kBadImage,          // an image that does not decode or has an unusable size
  kUnsupported,       // valid input we do not train on yet (videos)
  kNoSupervisedToken, // nothing to learn from (no assistant answer, or truncated away)
  kTooLong,           // longer than --max_length and truncation is off
  kCount,
};

// Short snake_case name for reports ("malformed_json", ...).
const char* skip_reason_name(SkipReason reason);

// Thrown while building one sample; the pipeline catches it, counts the reason and moves on. The
// detail names the form within the reason where there are several ("video", "audio", "objects" for
// kUnsupported; "remote_image", "raw_base64" for kMissingImage), so each is counted on its own.
class SampleSkip : public Error {
 public:
  SampleSkip(SkipReason reason, const std::string& message, std::string detail = "")
      : Error(message), reason_(reason), detail_(std::move(detail)) {}
  SkipReason reason() const { return reason_; }
  const std::string& detail() const { return detail_; }

 private:
  SkipReason reason_;
  std::string detail_;
};

}  // namespace deltamoe
