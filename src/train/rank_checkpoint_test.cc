// Model files written by every rank (train/rank_checkpoint.h): the directory that 2 or 4 ranks write,
// each its own byte ranges, is byte for byte the one a single rank writes from the same weights
// (tiny and tiny-vl, EP 2 and 4, replicated experts, f32 and bf16 files, one file and shards, both
// expert layouts, a frozen vision tower); a layout that would leave bytes unwritten or written twice
// is refused; the free-space check adds up the ranks that write to one file system.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>

#include "parallel/thread_comm.h"
#include "train/cpu_engine.h"
#include "train/parallel_test_util.h"
#include "train/rank_checkpoint.h"
#include "train/train_checkpoint.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Every file of two directories, by name: the number of files that differ (missing ones count).
int differing_files(const fs::path& a, const fs::path& b, int* num_files) {
  int differ = 0;
  *num_files = 0;
  for (const auto& entry : fs::directory_iterator(a)) {
    ++*num_files;
    const fs::path other = b / entry.path().filename();
    if (!fs::exists(other) || read_bytes(entry.path()) != read_bytes(other)) {
      ADD_FAILURE() << entry.path().filename() << " differs";
      ++differ;
    }
  }
  for (const auto& entry : fs::directory_iterator(b)) differ += !fs::exists(a / entry.path().filename());
  return differ;
}

struct Case {
  std::string preset;
  int world = 2;
  int ep = 2;
  DType dtype = DType::f32;
  bool freeze_vit = false;
  uint64_t max_shard_bytes = 0;  // 0: one model.safetensors
  ExpertLayout expert_layout = ExpertLayout::fused;
};

class RankModelFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / str_cat("deltamoe_rank_ckpt_", ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Trains one step on c.world ranks, then writes the model directory from every rank and, from
  // the ranks' pieces collected into one full state, as one rank would; compares the two.
  void check(const Case& c) {
    SCOPED_TRACE(str_cat(c.preset, " world ", c.world, " EP ", c.ep, " ", dtype_name(c.dtype),
                         c.freeze_vit ? " frozen ViT" : "", " shards ", c.max_shard_bytes, " ",
                         expert_layout_name(c.expert_layout)));
    constexpr int64_t kPerStep = 4;
    parallel_test::Setup setup = parallel_test::make_setup(c.preset, c.preset == "tiny-vl", c.freeze_vit, kPerStep, 1);
    setup.checkpoint = random_init_checkpoint(setup.checkpoint.config, 11, c.dtype);
    ParallelOptions parallel;
    parallel.expert_parallel_size = c.ep;
    parallel.distributed_optimizer = true;
    parallel.bucket_elements = 30000;  // several buckets, pieces that cut tensors
    SaveOptions save;
    save.max_shard_bytes = c.max_shard_bytes;
    save.expert_layout = c.expert_layout;
    const fs::path by_ranks = dir_ / "by_ranks", by_one = dir_ / "by_one";
    fs::remove_all(by_ranks);
    fs::remove_all(by_one);
    fs::create_directories(by_ranks);
    std::unique_ptr<HostTrainState> full;
    std::mutex mutex;
    run_thread_comm(c.world, [&](Communicator& comm) {
      CpuEngine engine(setup.checkpoint, setup.options, &comm, parallel);
      std::vector<MicroBatch> mine;
      for (int64_t g = 0; g < kPerStep / c.world; ++g) mine.push_back(setup.batches[g * c.world + comm.rank()]);
      engine.train_step(mine, 1e-2, 0.5);
      const RankModelShare share =
          plan_rank_model_share(comm, setup.checkpoint, engine.state(), engine.parallel_layout(), save);
      if (comm.rank() == 0) create_model_dir_files(share.layout, by_ranks.string());
      comm.barrier();
      write_model_dir_ranges(share.layout, by_ranks.string(), share.ranges);
      // The weights one rank would hold: every piece's master, collected through memory.
      std::lock_guard lock(mutex);
      if (!full) full = std::make_unique<HostTrainState>(engine.full_layout(), engine.state().adamw_config());
      const ParamLayout& pieces = engine.state().layout();
      for (int i = 0; i < pieces.num_tensors(); ++i) {
        const ParamEntry& entry = pieces.entry(i);
        std::vector<float> values(static_cast<size_t>(entry.numel));
        engine.state().read_state(StateKind::master, i, 0, entry.numel, values.data());
        full->write_state(StateKind::master, engine.full_layout().find(entry.name), entry.tensor_begin, entry.numel,
                          values.data());
      }
    });
    save_model_dir(checkpoint_with_state(setup.checkpoint, *full), by_one.string(), save);
    int num_files = 0;
    EXPECT_EQ(differing_files(by_ranks, by_one, &num_files), 0);
    EXPECT_GE(num_files, c.max_shard_bytes > 0 ? 4 : 2);  // config + weights (+ shards and index)
    // A control: the trained weights are not the initial ones.
    const fs::path initial = dir_ / "initial";
    fs::remove_all(initial);
    save_model_dir(setup.checkpoint, initial.string(), save);
    int differ = 0;
    for (const auto& entry : fs::directory_iterator(initial)) {
      differ += read_bytes(entry.path()) != read_bytes(by_ranks / entry.path().filename());
    }
    EXPECT_GT(differ, 0);
    std::printf("  %s, %d ranks, EP %d, %s%s%s: %d files byte-identical to one rank's save\n", c.preset.c_str(),
                c.world, c.ep, std::string(dtype_name(c.dtype)).c_str(), c.max_shard_bytes > 0 ? ", sharded" : "",
                c.expert_layout == ExpertLayout::per_expert ? ", per-expert files" : "", num_files);
  }

  fs::path dir_;
};

TEST_F(RankModelFiles, TinyTextByteIdenticalToOneRank) {
  check({"tiny", 2, 2, DType::f32});
  check({"tiny", 4, 4, DType::bf16});
  check({"tiny", 4, 2, DType::f32, false, 200000});  // replicated expert blocks, shards
}

TEST_F(RankModelFiles, TinyVlByteIdenticalToOneRank) {
  check({"tiny-vl", 2, 2, DType::bf16, false, 300000});
  check({"tiny-vl", 4, 4, DType::f32, true});  // frozen ViT: its tensors spread over the ranks
  check({"tiny-vl", 4, 2, DType::bf16, false, 0, ExpertLayout::per_expert});
}

// Without the layout, replicas of an expert block would each write it: refused on every rank
// before a byte is written.
TEST_F(RankModelFiles, DoubleWritersRefused) {
  parallel_test::Setup setup = parallel_test::make_setup("tiny", false, false, 4, 1);
  ParallelOptions parallel;
  parallel.expert_parallel_size = 2;
  parallel.distributed_optimizer = true;
  int refused = 0;
  std::mutex mutex;
  run_thread_comm(4, [&](Communicator& comm) {
    CpuEngine engine(setup.checkpoint, setup.options, &comm, parallel);
    try {
      plan_rank_model_share(comm, setup.checkpoint, engine.state(), nullptr, {});
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("every byte must have exactly one writer"), std::string::npos)
          << error.what();
      std::lock_guard lock(mutex);
      ++refused;
    }
  });
  EXPECT_EQ(refused, 4);
}

TEST(RankSaveSpace, RanksOfOneFileSystemAddUp) {
  EXPECT_EQ(bytes_sharing_storage({7, 7, 9, 7}, {10, 20, 40, 80}, 0), 110u);
  EXPECT_EQ(bytes_sharing_storage({7, 7, 9, 7}, {10, 20, 40, 80}, 2), 40u);
  // Threads of one process: one host, one output folder, so every rank's bytes count on each.
  const std::string dir = fs::temp_directory_path().string();
  for (const uint64_t free_bytes : {uint64_t{1999}, uint64_t{2000}}) {
    ::setenv("DELTAMOE_TEST_FREE_BYTES", std::to_string(free_bytes).c_str(), 1);
    std::vector<std::string> messages(2);
    run_thread_comm(2, [&](Communicator& comm) {
      try {
        check_save_space_on_ranks(comm, dir, 5, comm.rank() == 0 ? 1200 : 800, true);
      } catch (const Error& error) {
        messages[comm.rank()] = error.what();
      }
    });
    ::unsetenv("DELTAMOE_TEST_FREE_BYTES");
    if (free_bytes == 2000) {
      EXPECT_EQ(messages[0], "");
      EXPECT_EQ(messages[1], "");
    } else {
      for (const std::string& message : messages) {
        EXPECT_NE(message.find("checkpoint-5 needs"), std::string::npos) << message;
        EXPECT_NE(message.find("2 rank(s) writing to this file system"), std::string::npos) << message;
      }
    }
  }
}

}  // namespace
}  // namespace deltamoe
