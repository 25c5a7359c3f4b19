// Reading SFT lines into one form: the layout normalised (record_formats.h), image parts in the
// messages with their sources listed and resolved, and each message's loss switch.
#include "data/sft_record.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/json_depth.h"
#include "data/base64.h"
#include "data/record_formats.h"
#include "data/sample_skip.h"

namespace deltamoe {
namespace {

using Json = nlohmann::ordered_json;  // key order matters: tool arguments render in their order
constexpr std::string_view kImageTag = "<image>";

[[noreturn]] void bad(const std::string& where, const std::string& message) {
  throw SampleSkip(SkipReason::kBadConversation, where + ": " + message);
}

bool is_image_part(const Json& part) {
  if (!part.is_object()) return false;
  const bool typed = part.contains("type") && part["type"].is_string() &&
                     (part["type"] == "image" || part["type"] == "image_url");
  return typed || part.contains("image") || part.contains("image_url");
}

bool is_video_part(const Json& part) {
  return part.is_object() && (part.contains("video") || (part.contains("type") && part["type"] == "video"));
}

// The source string of an image part: "image": s, "image_url": s or "image_url": {"url": s}.
std::string image_source_of(const Json& part, const std::string& where) {
  for (const char* key : {"image", "image_url"}) {
    if (!part.contains(key)) continue;
    const Json& value = part[key];
    if (value.is_string()) return value.get<std::string>();
    if (value.is_object() && value.contains("url") && value["url"].is_string()) return value["url"].get<std::string>();
    if (value.is_object() && value.contains("path") && value["path"].is_string()) return value["path"].get<std::string>();
  }
  bad(where, "an image part needs a path or data URL in 'image' (or 'image_url'), got " + part.dump().substr(0, 200));
}

// ms-swift's images entries: a string, or {"path": ...}.
std::string listed_image_source(const Json& entry, const std::string& where) {
  if (entry.is_string()) return entry.get<std::string>();
  if (entry.is_object() && entry.contains("path") && entry["path"].is_string()) return entry["path"].get<std::string>();
  bad(where, "each 'images' entry must be a path or data URL string, got " + entry.dump().substr(0, 200));
}

size_t count_tags(std::string_view text) {
  size_t count = 0;
  for (size_t pos = text.find(kImageTag); pos != std::string_view::npos; pos = text.find(kImageTag, pos + kImageTag.size())) {
    ++count;
  }
  return count;
}

// "a<image>b" -> [{"type":"text","text":"a"}, {"type":"image"}, {"type":"text","text":"b"}].
Json split_on_tags(const std::string& text) {
  Json parts = Json::array();
  size_t start = 0;
  for (;;) {
    const size_t tag = text.find(kImageTag, start);
    const std::string piece = text.substr(start, tag == std::string::npos ? std::string::npos : tag - start);
    if (!piece.empty()) parts.push_back(Json{{"type", "text"}, {"text", piece}});
    if (tag == std::string::npos) break;
    parts.push_back(Json{{"type", "image"}});
    start = tag + kImageTag.size();
  }
  return parts;
}

// ms-swift layout: <image> tags in string contents take the listed images in order. With no tag
// at all, the images go in front of the first user message (as ms-swift does).
void place_listed_images(Json& messages, const Json& images, const std::string& where, std::vector<std::string>& sources) {
  std::vector<std::string> listed;
  if (images.is_string()) {
    listed.push_back(images.get<std::string>());
  } else if (images.is_array()) {
    for (const Json& entry : images) listed.push_back(listed_image_source(entry, where));
  } else if (!images.is_null()) {
    bad(where, "'images' must be a list of paths or data URLs");
  }
  size_t num_tags = 0;
  for (const Json& message : messages) {
    if (message.is_object() && message.contains("content") && message["content"].is_string()) {
      num_tags += count_tags(message["content"].get_ref<const std::string&>());
    }
  }
  if (num_tags > 0 && listed.empty()) {
    bad(where, str_cat("the messages hold ", num_tags, " <image> tag(s) but the line lists no images (an 'images' list "
                       "gives one path per tag)"));
  }
  if (num_tags == 0 && !listed.empty()) {
    for (Json& message : messages) {
      // NOTE: not message.value("role", ""), which throws when "role" holds a non-string.
      if (!message.is_object() || !message.contains("role") || message["role"] != "user") continue;
      if (message.contains("content") && message["content"].is_string()) {
        std::string tags;
        for (size_t i = 0; i < listed.size(); ++i) tags += kImageTag;
        message["content"] = tags + message["content"].get<std::string>();
        num_tags = listed.size();
      }
      break;
    }
  }
  if (num_tags != listed.size()) {
    bad(where, str_cat("the messages hold ", num_tags, " <image> tag(s) but 'images' lists ", listed.size()));
  }
  if (num_tags == 0) return;
  for (Json& message : messages) {
    if (message.is_object() && message.contains("content") && message["content"].is_string() &&
        count_tags(message["content"].get_ref<const std::string&>()) > 0) {
      message["content"] = split_on_tags(message["content"].get<std::string>());
    }
  }
  sources = std::move(listed);
}

}  // namespace

// Raw base64 image data (ms-swift also takes it without a data: prefix): long, base64 characters only.
static bool looks_like_raw_base64(const std::string& ref) {
  if (ref.size() < 256) return false;
  for (char c : ref) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '+' ||
                    c == '/' || c == '=' || c == '\n' || c == '\r';
    if (!ok) return false;
  }
  return ref.find('/') == std::string::npos || ref.find('.') == std::string::npos;
}

std::string resolve_image_ref(const std::string& ref, const ImageRoots& roots, const std::string& where) {
  namespace fs = std::filesystem;
  if (is_data_url(ref)) return ref;
  if (ref.starts_with("http://") || ref.starts_with("https://")) {
    throw SampleSkip(SkipReason::kMissingImage, where + ": image URL '" + ref.substr(0, 200) +
                     "' is not downloaded (deltamoe reads local files only); store the image locally and give its path",
                     "remote_image");
  }
  std::string path = ref.starts_with("file://") ? ref.substr(7) : ref;
  if (path.empty()) bad(where, "empty image path");
  const fs::path fs_path(path);
  std::error_code error;
  // A JPEG's base64 starts with "/9j/": it would pass for an absolute path.
  if (looks_like_raw_base64(path) && !fs::exists(fs_path, error) &&
      !fs::exists(fs::path(roots.dataset_dir) / fs_path, error)) {
    throw SampleSkip(SkipReason::kMissingImage, where + ": an image is base64 text without a 'data:image/...;base64,' "
                     "prefix; write it as a data URL (data:image/png;base64,...) or store the image as a file",
                     "raw_base64");
  }
  if (fs_path.is_absolute()) return path;
  if (!roots.media_dir.empty()) return (fs::path(roots.media_dir) / fs_path).string();
  // ms-swift resolves relative paths against the working directory; a dataset moved with its
  // images keeps working through its own folder.
  if (fs::exists(fs_path, error)) return fs::absolute(fs_path, error).string();
  return (fs::path(roots.dataset_dir) / fs_path).string();
}

std::string resolve_image_ref(const std::string& ref, const std::string& dataset_dir, const std::string& where) {
  return resolve_image_ref(ref, ImageRoots{dataset_dir, ""}, where);
}

namespace {

SftRecord parse_record(std::string_view line, const ImageRoots& roots, const std::string& where) {
  // Checked before parsing: printing a value nested deeper than this would overflow the stack.
  if (const int64_t depth = json_nesting_depth(line); depth > kMaxJsonDepth) {
    throw SampleSkip(SkipReason::kMalformedJson, str_cat(where, ": JSON nested more than ", kMaxJsonDepth,
                                                         " levels deep (at least ", depth, ")"));
  }
  Json parsed;
  try {
    parsed = Json::parse(line);
  } catch (const Json::exception& error) {
    throw SampleSkip(SkipReason::kMalformedJson, where + ": not valid JSON (" + error.what() + ")");
  }
  if (!parsed.is_object()) throw SampleSkip(SkipReason::kMalformedJson, where + ": a line must be a JSON object");
  Json root = normalise_record(std::move(parsed), where).root;
  Json& messages = root["messages"];
  SftRecord record;
  std::vector<std::string> sources;
  place_listed_images(messages, root.contains("images") ? root["images"] : Json(), where, sources);
  // Image parts written in the messages themselves (the first layout; with 'images' they are the
  // parts made from <image> tags, whose sources are already listed).
  size_t listed_index = 0;
  for (Json& message : messages) {
    if (!message.is_object() || !message.contains("content") || !message["content"].is_array()) continue;
    for (Json& part : message["content"]) {
      if (is_video_part(part)) throw SampleSkip(SkipReason::kUnsupported, where + ": videos are not supported yet", "video");
      if (!is_image_part(part)) continue;
      std::string source;
      if (part.contains("image") || part.contains("image_url")) {
        source = image_source_of(part, where);
      } else if (listed_index < sources.size()) {
        source = sources[listed_index++];
      } else {
        bad(where, "an image part has no source ('image' path or data URL)");
      }
      record.images.push_back(resolve_image_ref(source, roots, where));
      record.image_refs.push_back(source);
      part = Json{{"type", "image"}};  // the renderer needs only the kind; keeps the JSON small
    }
  }
  if (listed_index != sources.size()) {
    bad(where, str_cat("'images' lists ", sources.size(), " image(s) but ", listed_index, " were placed"));
  }
  for (const Json& message : messages) {
    const bool has_loss = message.is_object() && message.contains("loss") && message["loss"].is_boolean();
    record.message_loss.push_back(has_loss ? (message["loss"].get<bool>() ? 1 : 0) : -1);
  }
  record.messages_json = messages.dump();
  if (root.contains("tools") && !root["tools"].is_null()) {
    const Json& tools = root["tools"];
    if (tools.is_string()) {
      record.tools_json = tools.get<std::string>();  // some datasets store the list as a JSON string
      if (json_nesting_depth(record.tools_json) > kMaxJsonDepth) {
        throw SampleSkip(SkipReason::kMalformedJson,
                         str_cat(where, ": 'tools' holds JSON nested more than ", kMaxJsonDepth, " levels deep"));
      }
    } else if (tools.is_array()) {
      record.tools_json = tools.dump();
    } else {
      bad(where, "'tools' must be a list (or a JSON string holding one)");
    }
  }
  return record;
}

}  // namespace

SftRecord parse_sft_record(std::string_view line, const std::string& dataset_dir, const std::string& where) {
  return parse_sft_record(line, ImageRoots{dataset_dir, ""}, where);
}

SftRecord parse_sft_record(std::string_view line, const ImageRoots& roots, const std::string& where) {
  try {
    return parse_record(line, roots, where);
  } catch (const Json::exception& error) {  // a value of an unexpected type that a check above missed
    throw SampleSkip(SkipReason::kBadConversation, where + ": unexpected JSON layout (" + error.what() + ")");
  }
}

}  // namespace deltamoe
