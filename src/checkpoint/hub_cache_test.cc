// --model ORG/NAME: found in a Hugging Face hub cache (refs/main's snapshot, else the newest) or a
// ModelScope cache (names with '.' written '___'); otherwise a message with the download commands.
// Paths and plain names are left alone.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "checkpoint/hub_cache.h"
#include "core/error.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

void make_model_dir(const fs::path& dir) {
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << "{}";
}

struct Env {
  std::map<std::string, std::string> values;
  std::function<const char*(const char*)> getter() const {
    return [this](const char* name) -> const char* {
      auto it = values.find(name);
      return it == values.end() ? nullptr : it->second.c_str();
    };
  }
};

TEST(HubCache, RecognisesHubIds) {
  EXPECT_TRUE(looks_like_hub_id("Qwen/Qwen3.5-35B-A3B"));
  EXPECT_FALSE(looks_like_hub_id("/models/qwen"));
  EXPECT_FALSE(looks_like_hub_id("./Qwen/x"));
  EXPECT_FALSE(looks_like_hub_id("models/Qwen/x"));
  EXPECT_FALSE(looks_like_hub_id("tiny-vl"));
}

TEST(HubCache, FindsHuggingFaceAndModelScopeSnapshots) {
  const fs::path root = fs::temp_directory_path() / ("deltamoe_hub_" + std::to_string(::getpid()));
  fs::remove_all(root);
  const fs::path repo = root / "hf" / "models--Qwen--Qwen3.5-35B-A3B";
  make_model_dir(repo / "snapshots" / "aaa");
  make_model_dir(repo / "snapshots" / "bbb");
  fs::create_directories(repo / "refs");
  std::ofstream(repo / "refs" / "main") << "aaa\n";
  Env env;
  env.values["HF_HUB_CACHE"] = (root / "hf").string();
  env.values["HOME"] = (root / "home").string();
  EXPECT_EQ(resolve_model_dir("Qwen/Qwen3.5-35B-A3B", env.getter()), (repo / "snapshots" / "aaa").string());

  make_model_dir(root / "ms" / "models" / "Qwen" / "Qwen3___5-397B-A17B");
  env.values["MODELSCOPE_CACHE"] = (root / "ms").string();
  EXPECT_EQ(resolve_model_dir("Qwen/Qwen3.5-397B-A17B", env.getter()),
            (root / "ms" / "models" / "Qwen" / "Qwen3___5-397B-A17B").string());

  // HF_HOME/hub when HF_HUB_CACHE is not set.
  env.values.erase("HF_HUB_CACHE");
  env.values["HF_HOME"] = root.string();
  fs::rename(root / "hf", root / "hub");
  EXPECT_EQ(resolve_model_dir("Qwen/Qwen3.5-35B-A3B", env.getter()),
            (root / "hub" / "models--Qwen--Qwen3.5-35B-A3B" / "snapshots" / "aaa").string());

  try {
    resolve_model_dir("Qwen/Qwen3.5-122B-A10B", env.getter());
    ADD_FAILURE() << "a missing model resolved";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("huggingface-cli download Qwen/Qwen3.5-122B-A10B --local-dir Qwen3.5-122B-A10B"),
              std::string::npos) << message;
    EXPECT_NE(message.find("modelscope download --model Qwen/Qwen3.5-122B-A10B"), std::string::npos) << message;
  }
  EXPECT_EQ(resolve_model_dir("tiny-vl", env.getter()), "tiny-vl") << "not a hub id: left to the folder checks";
  fs::remove_all(root);
}

}  // namespace
}  // namespace deltamoe
