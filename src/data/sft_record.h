// One SFT dataset line, parsed: the conversation in the chat renderer's input form, the images it
// refers to (in order) and each message's loss switch. Every layout of record_formats.h is read; the
// images come as parts in the messages or as ms-swift's "images" list with <image> tags:
//   {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.jpg"}, {"type": "text", ...}]}, ...]}
//   {"messages": [{"role": "user", "content": "<image>What is this?"}, ...], "images": ["a.jpg"]}  (ms-swift)
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace deltamoe {

struct SftRecord {
  std::string messages_json;  // JSON list of messages; every image is a {"type": "image"} part
  std::string tools_json;     // JSON list of tools, or empty
  // Each image: a resolved file path or a data: URL, in the order the images appear; image_refs
  // holds what the line wrote (for messages).
  std::vector<std::string> images;
  std::vector<std::string> image_refs;
  // Per message of messages_json: -1 no "loss" given (the default mask), 0 "loss": false (nothing of
  // the message is trained), 1 "loss": true (the default mask).
  std::vector<int8_t> message_loss;
};

// Where relative image paths are looked for.
struct ImageRoots {
  std::string dataset_dir;  // the folder of the dataset file (absolute)
  std::string media_dir;    // --media_dir: when set, the only root of relative paths
};

// Parses one line; `where` (file:line) prefixes messages. Throws SampleSkip: kMalformedJson for bad
// JSON, kBadConversation for a wrong layout (no messages, <image> tags that do not match the images,
// an image part without a source), kMissingImage for http(s) URLs (never fetched) and base64 text
// without a data: prefix, kUnsupported for videos, audio and grounding objects.
SftRecord parse_sft_record(std::string_view line, const ImageRoots& roots, const std::string& where);
SftRecord parse_sft_record(std::string_view line, const std::string& dataset_dir, const std::string& where);

// Where an image reference points: data URLs stay as they are, file:// is stripped, absolute paths
// stay; a relative path joins --media_dir when given, else the working directory when the file is
// there (ms-swift's rule), else the dataset's folder.
std::string resolve_image_ref(const std::string& ref, const ImageRoots& roots, const std::string& where);
std::string resolve_image_ref(const std::string& ref, const std::string& dataset_dir, const std::string& where);

}  // namespace deltamoe
