// Tests of sharded weights directories: splitting by a byte budget, the index in both directions,
// stale-shard cleanup, and errors for inconsistent indexes (naming the file and tensor).
#include "checkpoint/sharded.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_test_util.h"

namespace deltamoe {
namespace {

std::vector<NamedTensor> make_tensors(int count, int64_t elements) {
  std::vector<NamedTensor> tensors;
  for (int t = 0; t < count; ++t) {
    HostTensor host(DType::bf16, {elements});
    for (int64_t i = 0; i < elements; ++i) host.as<bf16>()[i] = bf16(static_cast<float>(t * 1000 + i % 1000));
    tensors.push_back({"layer." + std::to_string(t) + ".weight", StoredTensor::from_host(host)});
  }
  return tensors;
}

TEST(ShardedWeights, SplitsByBudgetAndReadsBack) {
  ScratchDir dir("sharded_split");
  std::vector<NamedTensor> tensors = make_tensors(5, 1000);  // 2000 bytes each
  std::vector<std::string> files = write_weights_dir(dir.path(), tensors, 4500);
  // 2 tensors fit in 4500 bytes: shards of 2, 2, 1 plus the index.
  ASSERT_EQ(files.size(), 4u);
  EXPECT_EQ(files[0], "model-00001-of-00003.safetensors");
  EXPECT_EQ(files[3], kWeightsIndexFile);
  nlohmann::json index = nlohmann::json::parse(read_file_bytes(dir.path(kWeightsIndexFile)));
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), 5 * 2000);
  EXPECT_EQ(index["weight_map"]["layer.4.weight"].get<std::string>(), "model-00003-of-00003.safetensors");

  WeightsDir weights = open_weights_dir(dir.path());
  EXPECT_TRUE(weights.sharded);
  EXPECT_EQ(weights.files.size(), 3u);
  ASSERT_EQ(weights.tensors.size(), 5u);
  int mismatches = 0;
  for (const NamedTensor& tensor : tensors) mismatches += !weights.tensors.at(tensor.name).bitwise_equal(tensor.tensor);
  std::printf("sharded read back: %d of 5 tensors differ\n", mismatches);
  EXPECT_EQ(mismatches, 0);
}

TEST(ShardedWeights, OneFileWhenItFitsAndStaleShardsAreRemoved) {
  ScratchDir dir("sharded_single");
  std::vector<NamedTensor> tensors = make_tensors(3, 100);
  write_weights_dir(dir.path(), tensors, 200);  // sharded first
  EXPECT_TRUE(std::filesystem::exists(dir.path(kWeightsIndexFile)));
  std::vector<std::string> files = write_weights_dir(dir.path(), tensors, 0);
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0], kSingleWeightsFile);
  int remaining = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) remaining += entry.is_regular_file();
  EXPECT_EQ(remaining, 1) << "old shards and index must be gone";
  WeightsDir weights = open_weights_dir(dir.path());
  EXPECT_FALSE(weights.sharded);
  EXPECT_EQ(weights.tensors.size(), 3u);
}

TEST(ShardedWeights, IndexNamingAMissingShardIsReported) {
  ScratchDir dir("sharded_missing");
  write_weights_dir(dir.path(), make_tensors(3, 100), 200);
  std::filesystem::remove(dir.path("model-00002-of-00003.safetensors"));
  std::string message = error_of([&] { open_weights_dir(dir.path()); });
  std::printf("error as expected: %s\n", message.c_str());
  EXPECT_NE(message.find("layer.1.weight"), std::string::npos) << message;
  EXPECT_NE(message.find("model-00002-of-00003.safetensors"), std::string::npos) << message;
  EXPECT_NE(message.find("does not exist"), std::string::npos) << message;
}

TEST(ShardedWeights, TensorInTheWrongShardIsReported) {
  ScratchDir dir("sharded_wrong");
  // Two 200-byte tensors per shard: model-00001 holds layer.0 and layer.1.
  write_weights_dir(dir.path(), make_tensors(3, 100), 400);
  nlohmann::json index = nlohmann::json::parse(read_file_bytes(dir.path(kWeightsIndexFile)));
  index["weight_map"]["layer.0.weight"] = "model-00002-of-00002.safetensors";
  write_file_bytes(dir.path(kWeightsIndexFile), index.dump());
  std::string message = error_of([&] { open_weights_dir(dir.path()); });
  std::printf("error as expected: %s\n", message.c_str());
  EXPECT_NE(message.find("layer.0.weight"), std::string::npos) << message;
  EXPECT_NE(message.find("found in model-00001-of-00002.safetensors"), std::string::npos) << message;
}

TEST(ShardedWeights, ShardTensorMissingFromIndexIsReported) {
  ScratchDir dir("sharded_unlisted");
  // Two 200-byte tensors per shard: model-00001 holds layer.0 and layer.1.
  write_weights_dir(dir.path(), make_tensors(3, 100), 400);
  nlohmann::json index = nlohmann::json::parse(read_file_bytes(dir.path(kWeightsIndexFile)));
  index["weight_map"].erase("layer.1.weight");
  write_file_bytes(dir.path(kWeightsIndexFile), index.dump());
  std::string message = error_of([&] { open_weights_dir(dir.path()); });
  std::printf("error as expected: %s\n", message.c_str());
  EXPECT_NE(message.find("layer.1.weight"), std::string::npos) << message;
  EXPECT_NE(message.find("not listed"), std::string::npos) << message;
}

TEST(ShardedWeights, EmptyDirectoryIsReported) {
  ScratchDir dir("sharded_empty");
  std::string message = error_of([&] { open_weights_dir(dir.path()); });
  EXPECT_NE(message.find("no weights found"), std::string::npos) << message;
}

}  // namespace
}  // namespace deltamoe
