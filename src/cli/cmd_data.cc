// `deltamoe data`: reads SFT datasets exactly as training would (same pipeline, labels, packing)
// and reports samples, tokens, image tokens, supervised fraction, skips with reasons, packing
// efficiency and throughput; --preview K prints one rendered sample with its label mask.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "checkpoint/hub_cache.h"
#include "cli/args.h"
#include "cli/flag_compat.h"
#include "cli/swift_env.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "data/data_pipeline.h"
#include "data/image_processor_config.h"
#include "data/sample_skip.h"
#include "data/sft_record.h"
#include "model/config.h"
#include "tokenizer/chat_template_source.h"
#include "train/train_options.h"
#include "tokenizer/tokenizer.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

// Image settings from the model directory: the vision config (patch and merge sizes) and
// preprocessor_config.json through the loader `train` uses too; Qwen3.5 defaults without config.json.
void configure_images(const std::string& model_dir, const Tokenizer& tokenizer, const PixelOverrides& overrides,
                      SampleOptions& options) {
  const fs::path config_path = fs::path(model_dir) / "config.json";
  if (!fs::exists(config_path)) {
    log_warn(model_dir, " has no config.json; using Qwen3.5 image geometry (patch 16, merge 2)");
    options.image_config = load_image_processor_config(model_dir, VisionGeometry{}, tokenizer, overrides);
    return;
  }
  const ModelConfig config = load_model_config_file(config_path.string());
  options.allow_images = config.has_vision;
  if (config.has_vision) {
    const VisionGeometry vision{config.vision.patch_size, config.vision.temporal_patch_size,
                                config.vision.spatial_merge_size, config.image_token_id};
    options.image_config = load_image_processor_config(model_dir, vision, tokenizer, overrides);
  }
}

// --max_length's default: the model's max_position_embeddings (8192 without a config.json).
int64_t model_max_length(const std::string& model_dir) {
  const fs::path config_path = fs::path(model_dir) / "config.json";
  return fs::exists(config_path) ? load_model_config_file(config_path.string()).text.max_position_embeddings : 8192;
}

// The sample's text with supervised tokens between [[ and ]] and image token runs shortened.
std::string render_with_mask(const SftSample& sample, const Tokenizer& tokenizer, int32_t image_token_id) {
  std::string out;
  size_t i = 0;
  while (i < sample.input_ids.size()) {
    const bool image = sample.input_ids[i] == image_token_id;
    const bool supervised = sample.labels[i] != kIgnoreLabel;
    size_t j = i;
    while (j < sample.input_ids.size() && (sample.input_ids[j] == image_token_id) == image &&
           (sample.labels[j] != kIgnoreLabel) == supervised) {
      ++j;
    }
    if (image) {
      out += str_cat("<|image_pad|> x ", j - i);
    } else {
      const std::string text = tokenizer.decode(std::span<const int32_t>(sample.input_ids.data() + i, j - i));
      out += supervised ? "[[" + text + "]]" : text;
    }
    i = j;
  }
  return out;
}

void print_preview(const DatasetFiles& files, const SampleBuilder& builder, int64_t index) {
  CHECK(index >= 0 && index < files.size(), "--preview ", index, " is out of range: the datasets hold ", files.size(),
        " samples (0-based, file after file)");
  const DatasetFiles::Location location = files.locate(index);
  const std::string where = files.where(index);
  std::printf("\nsample %lld (%s)\n", static_cast<long long>(index), where.c_str());
  try {
    const SftRecord record = parse_sft_record(location.source->read(location.index),
                                              ImageRoots{location.source->directory(), builder.options().media_dir}, where);
    const SftSample sample = builder.build(record, index, where);
    std::printf("%lld tokens, %zu image(s) (%lld image tokens), %lld supervised%s; supervised text is inside [[ ]]\n",
                static_cast<long long>(sample.num_tokens()), sample.images.size(), static_cast<long long>(sample.num_image_tokens),
                static_cast<long long>(sample.num_supervised), sample.truncated ? ", truncated" : "");
    for (const ImagePatches& image : sample.images) {
      std::printf("  image grid (t, h, w) = (%lld, %lld, %lld)\n", static_cast<long long>(image.grid_thw[0]),
                  static_cast<long long>(image.grid_thw[1]), static_cast<long long>(image.grid_thw[2]));
    }
    std::printf("----\n%s\n----\n", render_with_mask(sample, builder.tokenizer(), builder.image_token_id()).c_str());
  } catch (const SampleSkip& skip) {
    std::printf("skipped (%s): %s\n", skip_reason_name(skip.reason()), skip.what());
  }
}

}  // namespace

int cmd_data(int argc, char** argv) {
  ArgParser args("data", "read SFT datasets as training would and report samples, tokens, labels, skips and packing");
  constexpr ArgKind kInt = ArgKind::kInteger;
  args.enable_config_file();
  args.add_list("dataset", "JSONL or JSON-array files (FILE#N takes N samples): messages, ShareGPT, alpaca or "
                "query/response lines, images as parts or an 'images' list with <image> tags", /*required=*/true);
  args.add_required("model", "model directory (tokenizer.json, config.json, preprocessor_config.json) or a cached hub id");
  args.add_option("max_length", "longest sample in tokens, image tokens included (default: the model's "
                  "max_position_embeddings)", "0", kInt);
  args.add_option("packing_length", "tokens per packed micro-batch (0: max_length)", "0", kInt);
  args.add_option("truncation_strategy", "samples over max_length: delete (skip, counted) or right (cut the end)", "delete");
  args.allow_values("truncation_strategy", {"delete", "right"}, "is not supported: use delete (skip, counted) or right");
  args.add_flag("supervise_all", "train on every token except image pads, not only assistant answers");
  args.add_option("template", "chat renderer: qwen3_5 or qwen3 (default: decided by the model's chat template)", "");
  args.add_bool("add_non_thinking_prefix", "a think block on every assistant turn, as ms-swift trains", false);
  args.add_option("preview", "also print sample K (0-based, file after file) with its label mask", std::nullopt, kInt);
  args.add_option("num_workers", "sample-building threads", "2", kInt);
  args.add_option("seed", "shuffle seed (and the #N draws)", "42", kInt);
  args.add_option("pack_window", "samples that may wait for a later micro-batch", "16", kInt);
  args.add_option("min_pixels", "override the image pixel lower bound (env MIN_PIXELS)", std::nullopt, kInt);
  args.add_option("max_pixels", "override the image pixel upper bound (env MAX_PIXELS)", std::nullopt, kInt);
  args.add_option("image_max_token_num", "most tokens per image (env IMAGE_MAX_TOKEN_NUM)", "0", kInt);
  args.add_option("max_decoded_pixels", "largest image (width x height as stored) that is decoded; larger ones are "
                  "skipped as decompression bombs (PIL's MAX_IMAGE_PIXELS)", std::to_string(kDefaultMaxDecodedPixels), kInt);
  args.add_option("media_dir", "root of relative image paths (default: the working directory, then the dataset "
                  "file's folder)", "");
  args.add_bool("strict", "stop at the first line that would be skipped", false);
  args.add_foreign(ForeignFlag{"chat_format", ForeignFlag::Action::kAlias, ArgKind::kText, "template", "", {}, ""});
  add_foreign_flags(args);
  if (!args.parse(argc, argv)) return 0;
  const SwiftEnv env = read_swift_env();
  if (!env.problems.empty()) RAISE("'deltamoe data': ", env.problems.front());
  for (const std::string& note : args.notes()) log_info("data: ", note);
  for (const std::string& note : env.notes) log_info("data: ", note);

  const std::string model_dir = resolve_model_dir(args.get("model"));
  const Tokenizer tokenizer = Tokenizer::load(model_dir);
  PipelineOptions options;
  options.dataset_paths = args.get_list("dataset");
  CHECK(!options.dataset_paths.empty(), "--dataset names no file");
  options.sample.chat_format = resolve_chat_format(model_dir, args.get("template"));
  options.sample.chat_options.think_on_every_turn = args.flag("add_non_thinking_prefix");
  options.sample.supervise_all = args.flag("supervise_all");
  options.sample.media_dir = args.get("media_dir");
  options.strict = args.flag("strict");
  options.sample.max_length = args.get_int("max_length");
  if (options.sample.max_length == 0) options.sample.max_length = model_max_length(model_dir);
  constexpr int64_t kMaxTokens = int64_t{1} << 24;  // as `train` allows
  CHECK(options.sample.max_length > 0 && options.sample.max_length <= kMaxTokens, "--max_length must be in [1, ",
        kMaxTokens, "], got ", options.sample.max_length);
  options.sample.truncate = args.get("truncation_strategy") == "right";
  PixelOverrides overrides;
  overrides.min_pixels = args.has("min_pixels") ? args.get_int("min_pixels") : env.min_pixels.value_or(0);
  overrides.max_pixels = args.has("max_pixels") ? args.get_int("max_pixels") : env.max_pixels.value_or(0);
  const int64_t token_cap = args.get_int("image_max_token_num") > 0 ? args.get_int("image_max_token_num")
                                                                      : env.image_max_token_num.value_or(0);
  if (token_cap > 0) {
    const int64_t pixels = image_tokens_to_pixels(model_dir, token_cap);
    overrides.max_pixels = overrides.max_pixels > 0 ? std::min(overrides.max_pixels, pixels) : pixels;
  }
  if (env.image_min_token_num) {
    overrides.min_pixels = std::max(overrides.min_pixels, image_tokens_to_pixels(model_dir, *env.image_min_token_num));
  }
  CHECK(overrides.min_pixels >= 0 && overrides.max_pixels >= 0, "--min_pixels / --max_pixels must be positive");
  configure_images(model_dir, tokenizer, overrides, options.sample);
  const int64_t max_decoded_pixels = args.get_int("max_decoded_pixels");
  CHECK(max_decoded_pixels > 0, "--max_decoded_pixels must be positive, got ", max_decoded_pixels);
  options.sample.image_limits.max_decoded_pixels = max_decoded_pixels;
  const int64_t packing_length = args.get_int("packing_length");
  CHECK(packing_length >= 0 && packing_length <= kMaxTokens, "--packing_length must be in [0, ", kMaxTokens, "], got ",
        packing_length);
  options.token_budget = packing_length > 0 ? packing_length : options.sample.max_length;
  const int64_t num_workers = args.get_int("num_workers");
  CHECK(num_workers >= 0 && num_workers <= 256, "--num_workers must be in 0..256, got ", num_workers);
  options.num_workers = static_cast<int>(num_workers);
  const int64_t seed = args.get_int("seed");
  CHECK(seed >= 0, "--seed must be non-negative, got ", seed);
  options.seed = static_cast<uint64_t>(seed);
  const int64_t window = args.get_int("pack_window");
  CHECK(window >= 1 && window <= 65536, "--pack_window must be in [1, 65536], got ", window);
  options.pack_window = static_cast<size_t>(window);

  DataPipeline pipeline(options, tokenizer);
  int64_t num_batches = 0, num_samples = 0, num_tokens = 0, num_image_tokens = 0, num_images = 0, num_supervised = 0;
  int64_t max_batch_tokens = 0;
  const auto start = std::chrono::steady_clock::now();
  while (std::optional<MicroBatch> batch = pipeline.next_batch()) {
    ++num_batches;
    num_samples += batch->num_samples();
    num_tokens += batch->num_tokens();
    num_image_tokens += batch->num_image_tokens;
    num_images += static_cast<int64_t>(batch->image_grid_thw.size());
    num_supervised += batch->num_supervised;
    max_batch_tokens = std::max(max_batch_tokens, batch->num_tokens());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const SkipStats& skips = pipeline.skip_stats();
  const auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };

  std::printf("datasets:    %zu file(s), %lld lines\n", options.dataset_paths.size(), static_cast<long long>(pipeline.num_samples()));
  std::printf("samples:     %lld kept, %s\n", static_cast<long long>(num_samples), skips.summary().c_str());
  std::printf("tokens:      %lld (%.1f per sample), max_length %lld\n", static_cast<long long>(num_tokens),
              ratio(static_cast<double>(num_tokens), static_cast<double>(num_samples)), static_cast<long long>(options.sample.max_length));
  std::printf("images:      %lld, %lld image tokens (%.1f%% of tokens)\n", static_cast<long long>(num_images),
              static_cast<long long>(num_image_tokens), 100 * ratio(static_cast<double>(num_image_tokens), static_cast<double>(num_tokens)));
  std::printf("supervised:  %lld tokens (%.1f%% of tokens)\n", static_cast<long long>(num_supervised),
              100 * ratio(static_cast<double>(num_supervised), static_cast<double>(num_tokens)));
  std::printf("packing:     %lld micro-batches of <= %lld tokens (largest %lld), efficiency %.1f%%\n",
              static_cast<long long>(num_batches), static_cast<long long>(options.token_budget), static_cast<long long>(max_batch_tokens),
              100 * ratio(static_cast<double>(num_tokens), static_cast<double>(num_batches * options.token_budget)));
  std::printf("throughput:  %.1f samples/s, %.0f tokens/s (%d worker thread(s), %.2f s)\n",
              ratio(static_cast<double>(num_samples + skips.total()), seconds), ratio(static_cast<double>(num_tokens), seconds),
              options.num_workers, seconds);
  if (!skips.first_messages().empty()) {
    std::printf("first skips:\n");
    for (const std::string& message : skips.first_messages()) std::printf("  %s\n", message.c_str());
  }
  if (args.has("preview")) {
    SampleOptions preview_options = options.sample;
    const SampleBuilder builder(tokenizer, preview_options);
    print_preview(pipeline.files(), builder, args.get_int("preview"));
  }
  return 0;
}

}  // namespace deltamoe
