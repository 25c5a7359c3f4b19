// One SFT dataset line, parsed: the conversation in the chat renderer's input form and the images
// it refers to, in order. Two layouts are read:
//   {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.jpg"}, {"type": "text", ...}]}, ...]}
//   {"messages": [{"role": "user", "content": "<image>What is this?"}, ...], "images": ["a.jpg"]}  (ms-swift)
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace deltamoe {

struct SftRecord {
  std::string messages_json;  // JSON list of messages; every image is a {"type": "image"} part
  std::string tools_json;     // JSON list of tools, or empty
  // Each image: an absolute/resolved file path or a data: URL, in the order the images appear.
  std::vector<std::string> images;
};

// Parses one line. Relative image paths resolve against dataset_dir; `where` (file:line) prefixes
// messages. Throws SampleSkip: kMalformedJson for bad JSON, kBadConversation for a wrong layout
// (no messages, <image> tags that do not match the images list, an image part without a source),
// kMissingImage for http(s) URLs (never fetched), kUnsupported for videos.
SftRecord parse_sft_record(std::string_view line, const std::string& dataset_dir, const std::string& where);

// Where an image reference points: data URLs stay as they are, file:// is stripped, relative
// paths are joined to dataset_dir.
std::string resolve_image_ref(const std::string& ref, const std::string& dataset_dir, const std::string& where);

}  // namespace deltamoe
