// Sample building: render, tokenize, label, expand image pads, limit the length, position.
#include "data/sample_builder.h"

#include <algorithm>

#include "data/sample_image.h"
#include "data/sample_positions.h"
#include "data/sample_skip.h"

namespace deltamoe {
namespace {

// Library messages name the sample only sometimes; a skip report always must.
std::string with_where(const std::string& where, const char* message) {
  const std::string text = message;
  return text.find(where) == std::string::npos ? where + ": " + text : text;
}

// Cuts the sample to max_length tokens without splitting an image: an image whose run does not fit
// whole is dropped together with everything after it.
void truncate_sample(SftSample& sample, int64_t max_length, int32_t image_token_id, int64_t merge_size) {
  int64_t cut = max_length;
  size_t kept_images = 0;
  int64_t token = 0;
  for (const ImagePatches& image : sample.images) {
    while (sample.input_ids[static_cast<size_t>(token)] != image_token_id) ++token;
    const int64_t run = image.num_patches() / (merge_size * merge_size);
    if (token + run > cut) {
      cut = std::min(cut, token);
      break;
    }
    token += run;
    ++kept_images;
  }
  sample.images.resize(kept_images);
  sample.input_ids.resize(static_cast<size_t>(cut));
  sample.labels.resize(static_cast<size_t>(cut));
  sample.truncated = true;
}

}  // namespace

SampleBuilder::SampleBuilder(Tokenizer tokenizer, SampleOptions options)
    : tokenizer_(std::move(tokenizer)), options_(std::move(options)),
      image_token_id_(tokenizer_.require_token_id("<|image_pad|>")) {
  CHECK(options_.max_length >= 0, "max_length must be >= 0, got ", options_.max_length);
}

SftSample SampleBuilder::build(const SftRecord& record, int64_t sample_index, const std::string& where) const {
  SftSample sample;
  sample.sample_index = sample_index;
  if (!options_.allow_images && !record.images.empty()) {
    throw SampleSkip(SkipReason::kUnsupported, where + ": the sample has images but the model has no vision tower");
  }
  RenderedChat chat;
  try {
    chat = render_chat(parse_chat(record.messages_json, record.tools_json, where), options_.chat_format, options_.chat_options);
  } catch (const SampleSkip&) {
    throw;
  } catch (const Error& error) {
    throw SampleSkip(SkipReason::kBadConversation, with_where(where, error.what()));
  }
  if (chat.num_videos > 0) throw SampleSkip(SkipReason::kUnsupported, where + ": videos are not supported yet");
  if (static_cast<size_t>(chat.num_images) != record.images.size()) {
    throw SampleSkip(SkipReason::kBadConversation, str_cat(where, ": rendered ", chat.num_images, " image(s) for ",
                                                           record.images.size(), " image source(s)"));
  }
  sample.images.reserve(record.images.size());
  for (size_t i = 0; i < record.images.size(); ++i) {
    const std::string& ref = record.images[i];
    try {
      sample.images.push_back(options_.measure_images_only
                                  ? measure_sample_image(ref, options_.image_config, options_.image_limits, where)
                                  : load_sample_image(ref, options_.image_config, options_.image_limits, where));
    } catch (const SampleSkip& skip) {
      const bool relative = i < record.image_refs.size() && !record.image_refs[i].empty() &&
                            record.image_refs[i][0] != '/' && !record.image_refs[i].starts_with("data:") &&
                            !record.image_refs[i].starts_with("file://");
      if (skip.reason() != SkipReason::kMissingImage || !relative) throw;
      throw SampleSkip(skip.reason(), str_cat(skip.what(), " (the line gives the relative path '", record.image_refs[i],
                                              "': looked up in ", options_.media_dir.empty()
                                                  ? std::string("the working directory, then the dataset's folder")
                                                  : "--media_dir " + options_.media_dir, ")"),
                       skip.detail());
    }
  }

  std::vector<int32_t> ids, span_of_token;
  try {
    encode_chat(tokenizer_, chat, ids, span_of_token);
  } catch (const Error& error) {
    throw SampleSkip(SkipReason::kBadConversation, with_where(where, error.what()));  // e.g. invalid UTF-8 in the text
  }
  const int64_t merge = options_.image_config.merge_size;
  const int64_t image_pads = std::count(ids.begin(), ids.end(), image_token_id_);
  if (image_pads != static_cast<int64_t>(sample.images.size())) {
    throw SampleSkip(SkipReason::kBadConversation,
                     str_cat(where, ": the text holds ", image_pads, " <|image_pad|> token(s) for ", sample.images.size(),
                             " image(s); is '<|image_pad|>' written literally in a message?"));
  }
  // Expand each pad to its image's merged token count; pads are never supervised.
  size_t image = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const ChatSpan& span = chat.spans[static_cast<size_t>(span_of_token[i])];
    // A message's "loss": false keeps all of it out of the loss (ms-swift's per-message switch).
    const bool loss_off = span.message_index >= 0 && static_cast<size_t>(span.message_index) < record.message_loss.size() &&
                          record.message_loss[static_cast<size_t>(span.message_index)] == 0;
    const bool supervised = options_.supervise_all || (supervised_by_default(span.role) && !loss_off);
    if (ids[i] != image_token_id_) {
      sample.input_ids.push_back(ids[i]);
      sample.labels.push_back(supervised ? ids[i] : kIgnoreLabel);
      continue;
    }
    const int64_t run = sample.images[image++].num_patches() / (merge * merge);
    sample.input_ids.insert(sample.input_ids.end(), static_cast<size_t>(run), image_token_id_);
    sample.labels.insert(sample.labels.end(), static_cast<size_t>(run), kIgnoreLabel);
  }

  if (options_.max_length > 0 && sample.num_tokens() > options_.max_length) {
    if (!options_.truncate) {
      throw SampleSkip(SkipReason::kTooLong, str_cat(where, ": ", sample.num_tokens(), " tokens > --max_length ",
                                                     options_.max_length, " (dropped; --truncation_strategy right keeps the start)"));
    }
    truncate_sample(sample, options_.max_length, image_token_id_, merge);
  }
  for (const ImagePatches& kept : sample.images) sample.num_image_tokens += kept.num_patches() / (merge * merge);
  sample.num_supervised = std::count_if(sample.labels.begin(), sample.labels.end(), [](int32_t l) { return l != kIgnoreLabel; });
  if (sample.num_supervised == 0) {
    throw SampleSkip(SkipReason::kNoSupervisedToken,
                     str_cat(where, sample.truncated ? ": no supervised token left after truncation to " : ": no supervised token",
                             sample.truncated ? std::to_string(options_.max_length) : std::string(" (no assistant answer?)")));
  }
  std::vector<std::array<int64_t, 3>> grids;
  for (const ImagePatches& kept : sample.images) grids.push_back(kept.grid_thw);
  sample.positions = compute_sample_positions(sample.input_ids, grids, merge, image_token_id_);
  return sample;
}

}  // namespace deltamoe
