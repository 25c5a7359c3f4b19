// The pipeline end to end on generated datasets: bad lines of every kind counted and reported
// (never lost silently), two layouts and relative paths mixed, every sample once per epoch,
// shuffle determinism (seed, epoch, thread count), and exact resume from saved positions.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "data/data_pipeline.h"
#include "data/data_test_util.h"

namespace deltamoe {
namespace {

using data_test::chat_line;
using data_test::qwen3_tokenizer;
namespace fs = std::filesystem;

// Two good files in different folders (both layouts, relative image paths, a data URL) with
// num_good samples in all.
struct GoodDataset {
  std::vector<std::string> paths;
  int64_t num_good = 0;
};

GoodDataset make_good_dataset(const fs::path& folder) {
  GoodDataset dataset;
  std::string a, b;
  data_test::write_bytes(folder / "a/img/square.jpg", data_test::jpeg_bytes(64, 64));  // 4 tokens
  data_test::write_bytes(folder / "b/pics/wide.jpg", data_test::jpeg_bytes(64, 128));  // 8 tokens
  for (int i = 0; i < 24; ++i) {
    std::string answer = "Answer " + std::to_string(i);
    for (int k = 0; k < i % 7; ++k) answer += " and more words";
    if (i % 3 == 0) {
      a += R"({"messages": [{"role": "user", "content": [{"type": "image", "image": "img/square.jpg"}, {"type": "text", "text": "Q)" +
           std::to_string(i) + R"("}]}, {"role": "assistant", "content": ")" + answer + "\"}]}\n";
    } else {
      a += chat_line("Question " + std::to_string(i), answer);
    }
    b += R"({"messages": [{"role": "user", "content": "<image>Look )" + std::to_string(i) + R"("}, {"role": "assistant", "content": ")" +
         answer + R"("}], "images": ["pics/wide.jpg"]})" + "\n";
    dataset.num_good += 2;
  }
  a += R"({"messages": [{"role": "user", "content": [{"type": "image", "image": ")" + data_test::jpeg_data_url(32, 96) +
       R"("}]}, {"role": "assistant", "content": "Embedded."}]})" + "\n";
  ++dataset.num_good;
  data_test::write_text(folder / "a/train.jsonl", a);
  data_test::write_text(folder / "b/swift.jsonl", b);
  dataset.paths = {(folder / "a/train.jsonl").string(), (folder / "b/swift.jsonl").string()};
  return dataset;
}

PipelineOptions small_options(const std::vector<std::string>& paths) {
  PipelineOptions options;
  options.dataset_paths = paths;
  options.sample.image_config = data_test::small_image_config();
  options.token_budget = 160;
  options.pack_window = 4;
  options.num_workers = 2;
  options.prefetch = 8;
  options.seed = 1234;
  return options;
}

void expect_same_batch(const MicroBatch& a, const MicroBatch& b, size_t batch_index) {
  SCOPED_TRACE("batch " + std::to_string(batch_index));
  EXPECT_EQ(a.sample_indices, b.sample_indices);
  EXPECT_EQ(a.input_ids, b.input_ids);
  EXPECT_EQ(a.labels, b.labels);
  EXPECT_EQ(a.cu_seqlens, b.cu_seqlens);
  EXPECT_EQ(a.positions, b.positions);
  EXPECT_EQ(a.image_grid_thw, b.image_grid_thw);
  EXPECT_EQ(a.pixel_values, b.pixel_values);
  EXPECT_EQ(a.position_after, b.position_after);
}

std::vector<int64_t> sample_order(const std::vector<MicroBatch>& batches) {
  std::vector<int64_t> order;
  for (const MicroBatch& batch : batches) order.insert(order.end(), batch.sample_indices.begin(), batch.sample_indices.end());
  return order;
}

TEST(DataPipeline, BadSamplesAreSkippedCountedAndReported) {
  const auto folder = data_test::temp_folder();
  data_test::write_bytes(folder / "ok.jpg", data_test::jpeg_bytes(64, 64));
  data_test::write_bytes(folder / "corrupt.jpg", {0xFF, 0xD8, 0xFF, 0xDB, 0x00, 0x43, 0x00, 0x01});
  data_test::write_bytes(folder / "empty.png", {});
  std::string long_answer;
  for (int i = 0; i < 100; ++i) long_answer += "word ";
  const std::string lines[] = {
      chat_line("good one", "yes"),                                                                          // good
      R"({"messages": [{"role": "user", "content": "unterminated)",                                           // malformed
      "not json at all",                                                                                     // malformed
      "",                                                                                                    // blank: not a sample
      R"({"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}], "images": ["gone.jpg"]})",  // missing
      R"({"messages": [{"role": "user", "content": [{"type": "image", "image": "/no/such/dir/a.png"}]}, {"role": "assistant", "content": "y"}]})",  // missing
      R"({"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}], "images": ["corrupt.jpg"]})",  // bad image
      R"({"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}], "images": ["empty.png"]})",  // bad image
      R"({"messages": [{"role": "user", "content": "nobody answers"}]})",                                   // no supervised token
      chat_line("long", long_answer),                                                                        // too long
      R"({"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "fine"}], "images": ["ok.jpg"]})",  // good
      R"({"messages": [{"role": "user", "content": "<image><image>"}, {"role": "assistant", "content": "y"}], "images": ["ok.jpg"]})",  // bad conversation
      R"({"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}, {"role": "assistant", "content": "y"}]})",  // unsupported
      chat_line("good two", "also yes"),                                                                     // good
  };
  std::string text;
  for (const std::string& line : lines) text += line + "\n";
  data_test::write_text(folder / "mixed.jsonl", text);

  PipelineOptions options = small_options({(folder / "mixed.jsonl").string()});
  options.token_budget = 64;
  options.num_skip_messages = 3;
  DataPipeline pipeline(options, qwen3_tokenizer());
  EXPECT_EQ(pipeline.num_samples(), 13);
  const std::vector<MicroBatch> batches = data_test::run_to_end(pipeline);
  std::vector<int64_t> order = sample_order(batches);
  std::sort(order.begin(), order.end());
  EXPECT_EQ(order, (std::vector<int64_t>{0, 9, 12}));
  const SkipStats& skips = pipeline.skip_stats();
  EXPECT_EQ(skips.count(SkipReason::kMalformedJson), 2);
  EXPECT_EQ(skips.count(SkipReason::kMissingImage), 2);
  EXPECT_EQ(skips.count(SkipReason::kBadImage), 2);
  EXPECT_EQ(skips.count(SkipReason::kNoSupervisedToken), 1);
  EXPECT_EQ(skips.count(SkipReason::kTooLong), 1);
  EXPECT_EQ(skips.count(SkipReason::kBadConversation), 1);
  EXPECT_EQ(skips.count(SkipReason::kUnsupported), 1);
  EXPECT_EQ(skips.total() + static_cast<int64_t>(order.size()), pipeline.num_samples()) << "a sample went missing";
  ASSERT_EQ(skips.first_messages().size(), 3u);
  for (const std::string& message : skips.first_messages()) {
    EXPECT_NE(message.find("mixed.jsonl:"), std::string::npos) << "skip message must name file:line: " << message;
  }
  std::printf("%s\n", skips.summary().c_str());
  for (const std::string& message : skips.first_messages()) std::printf("  %s\n", message.c_str());

  // Truncation instead of dropping keeps the long sample and counts it.
  options.sample.truncate = true;
  DataPipeline truncating(options, qwen3_tokenizer());
  const std::vector<MicroBatch> kept = data_test::run_to_end(truncating);
  EXPECT_EQ(sample_order(kept).size(), 4u);
  EXPECT_EQ(truncating.skip_stats().num_truncated(), 1);
  EXPECT_EQ(truncating.skip_stats().count(SkipReason::kTooLong), 0);
  for (const MicroBatch& batch : kept) EXPECT_LE(batch.num_tokens(), 64);
}

TEST(DataPipeline, EveryGoodSampleOncePerEpochAcrossMixedFiles) {
  const auto folder = data_test::temp_folder();
  const GoodDataset dataset = make_good_dataset(folder);
  PipelineOptions options = small_options(dataset.paths);
  options.num_epochs = 2;
  DataPipeline pipeline(options, qwen3_tokenizer());
  ASSERT_EQ(pipeline.num_samples(), dataset.num_good);
  std::vector<std::vector<int64_t>> per_epoch(2);
  int64_t num_images = 0, tokens = 0;
  for (std::optional<MicroBatch> batch; (batch = pipeline.next_batch());) {
    EXPECT_LE(batch->num_tokens(), options.token_budget);
    per_epoch[static_cast<size_t>(pipeline.epoch())].insert(per_epoch[static_cast<size_t>(pipeline.epoch())].end(),
                                                             batch->sample_indices.begin(), batch->sample_indices.end());
    num_images += static_cast<int64_t>(batch->image_grid_thw.size());
    tokens += batch->num_tokens();
  }
  EXPECT_EQ(pipeline.skip_stats().total(), 0) << pipeline.skip_stats().summary();
  EXPECT_EQ(num_images, 2 * (8 + 24 + 1));
  for (auto& order : per_epoch) {
    std::vector<int64_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> all(static_cast<size_t>(dataset.num_good));
    std::iota(all.begin(), all.end(), int64_t{0});
    EXPECT_EQ(sorted, all);
  }
  EXPECT_NE(per_epoch[0], per_epoch[1]) << "each epoch has its own order";
  std::printf("2 epochs: %lld tokens, %lld images\n", static_cast<long long>(tokens), static_cast<long long>(num_images));
}

TEST(DataPipeline, ShuffleDependsOnSeedAndEpochNotOnThreads) {
  const auto folder = data_test::temp_folder();
  const GoodDataset dataset = make_good_dataset(folder);
  PipelineOptions options = small_options(dataset.paths);
  options.num_epochs = 2;
  options.num_workers = 0;
  DataPipeline reference_pipeline(options, qwen3_tokenizer());
  const std::vector<MicroBatch> reference = data_test::run_to_end(reference_pipeline);
  for (const int workers : {1, 3}) {
    options.num_workers = workers;
    options.prefetch = workers == 1 ? 1 : 50;
    DataPipeline pipeline(options, qwen3_tokenizer());
    const std::vector<MicroBatch> batches = data_test::run_to_end(pipeline);
    ASSERT_EQ(batches.size(), reference.size()) << workers << " workers";
    for (size_t i = 0; i < batches.size(); ++i) expect_same_batch(batches[i], reference[i], i);
  }
  options.seed = 99;
  DataPipeline other_seed(options, qwen3_tokenizer());
  EXPECT_NE(sample_order(data_test::run_to_end(other_seed)), sample_order(reference));
  // Without shuffling and with in-order packing, samples come in file order.
  options.shuffle = false;
  options.pack_window = 1;
  options.num_epochs = 1;
  DataPipeline in_order(options, qwen3_tokenizer());
  std::vector<int64_t> all(static_cast<size_t>(dataset.num_good));
  std::iota(all.begin(), all.end(), int64_t{0});
  EXPECT_EQ(sample_order(data_test::run_to_end(in_order)), all);
}

TEST(DataPipeline, ResumeFromAnySavedPositionGivesTheSameRest) {
  const auto folder = data_test::temp_folder();
  const GoodDataset dataset = make_good_dataset(folder);
  PipelineOptions options = small_options(dataset.paths);
  options.num_epochs = 2;
  DataPipeline straight(options, qwen3_tokenizer());
  const std::vector<MicroBatch> all = data_test::run_to_end(straight);
  ASSERT_GT(all.size(), 10u);
  int resumes_with_pending = 0, resumes = 0;
  for (size_t k = 0; k + 1 < all.size(); k += 3) {
    const std::string saved = data_position_to_json(all[k].position_after);
    const DataPosition position = data_position_from_json(saved, "test");
    EXPECT_EQ(position, all[k].position_after);
    resumes_with_pending += !position.pending_slots.empty();
    ++resumes;
    options.num_workers = static_cast<int>(k % 3);  // thread count may differ after a restart
    DataPipeline resumed(options, qwen3_tokenizer(), position);
    const std::vector<MicroBatch> rest = data_test::run_to_end(resumed);
    ASSERT_EQ(rest.size(), all.size() - k - 1) << "resume after batch " << k;
    for (size_t i = 0; i < rest.size(); ++i) expect_same_batch(rest[i], all[k + 1 + i], k + 1 + i);
  }
  std::printf("%d resumes checked, %d with samples waiting in the packer\n", resumes, resumes_with_pending);
  EXPECT_GT(resumes_with_pending, 0) << "no resume exercised the packer carry-over";

  // The end of the stream resumes to nothing; a position from other data or seed is refused.
  DataPipeline finished(options, qwen3_tokenizer(), all.back().position_after);
  EXPECT_FALSE(finished.next_batch().has_value());
  DataPosition other = all[2].position_after;
  other.seed += 1;
  EXPECT_THROW(DataPipeline(options, qwen3_tokenizer(), other), Error);
  other = all[2].position_after;
  other.num_samples += 1;
  EXPECT_THROW(DataPipeline(options, qwen3_tokenizer(), other), Error);
  EXPECT_THROW(data_position_from_json(R"({"epoch": 0})", "state.json"), Error);
}

TEST(DataPipeline, UnreadableInputsAreErrorsNotCrashes) {
  const auto folder = data_test::temp_folder();
  EXPECT_THROW(DataPipeline(small_options({(folder / "missing.jsonl").string()}), qwen3_tokenizer()), Error);
  data_test::write_text(folder / "blank.jsonl", "\n\n");
  EXPECT_THROW(DataPipeline(small_options({(folder / "blank.jsonl").string()}), qwen3_tokenizer()), Error);
  data_test::write_text(folder / "one.jsonl", chat_line("q", "a"));
  PipelineOptions options = small_options({(folder / "one.jsonl").string()});
  options.sample.max_length = options.token_budget + 1;
  EXPECT_THROW(DataPipeline(options, qwen3_tokenizer()), Error);
}

}  // namespace
}  // namespace deltamoe
