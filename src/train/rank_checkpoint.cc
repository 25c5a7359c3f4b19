// Each rank's part of a checkpoint on several ranks (see rank_checkpoint.h).
#include "train/rank_checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <map>

#include "core/error.h"
#include "train/train_checkpoint.h"

namespace deltamoe {

uint64_t RankModelShare::range_bytes() const {
  uint64_t bytes = 0;
  for (const TensorByteRange& range : ranges) bytes += range.end - range.begin;
  return bytes;
}

RankModelShare plan_rank_model_share(Communicator& world, const ModelCheckpoint& base, const TrainStateStore& state,
                                     const ParallelLayout* parallel, const SaveOptions& options) {
  RankModelShare share;
  share.weights = checkpoint_with_state(base, state);
  share.layout = plan_model_dir(share.weights, options);
  const int rank = world.rank(), world_size = world.size();

  // The element ranges this rank writes of each trained tensor: its pieces, less the expert pieces
  // of a replica that is not its block's first.
  const ParamLayout& pieces = state.layout();
  std::vector<bool> skipped(static_cast<size_t>(pieces.num_tensors()), false);
  if (parallel != nullptr && !parallel->first_expert_replica()) {
    for (const auto& [state_index, full_index] : parallel->expert_pieces()) skipped[static_cast<size_t>(state_index)] = true;
  }
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> owned;  // tensor -> [begin, end) elements
  for (int i = 0; i < pieces.num_tensors(); ++i) {
    const ParamEntry& entry = pieces.entry(i);
    std::vector<std::pair<int64_t, int64_t>>& ranges = owned[entry.name];  // trained, even when skipped
    if (!skipped[static_cast<size_t>(i)]) ranges.emplace_back(entry.tensor_begin, entry.tensor_begin + entry.numel);
  }
  // Trained tensors are those of the full layout; every rank holds a piece of each dense one, but an
  // expert stack of a layer lives on its owners only, so "trained" is what the job trains.
  const ParamLayout* full = parallel != nullptr ? &parallel->full() : &pieces;

  const std::vector<NamedTensor>& tensors = share.layout.contents.tensors;
  std::vector<int64_t> written(tensors.size(), 0);
  for (size_t t = 0; t < tensors.size(); ++t) {
    const ModelDirContents::Source& source = share.layout.contents.sources[t];
    const uint64_t nbytes = tensors[t].tensor.nbytes();
    if (source.param.empty() || full->find(source.param) < 0) {
      if (static_cast<int>(t % static_cast<size_t>(world_size)) == rank) share.ranges.push_back({t, 0, nbytes});
    } else {
      const uint64_t element = dtype_size(tensors[t].tensor.dtype());
      auto it = owned.find(source.param);
      if (it == owned.end()) continue;
      for (const auto& [begin, end] : it->second) {
        // The piece's bytes in the parameter, intersected with this file tensor's slice of it.
        const uint64_t lo = std::max<uint64_t>(static_cast<uint64_t>(begin) * element, source.byte_offset);
        const uint64_t hi = std::min<uint64_t>(static_cast<uint64_t>(end) * element, source.byte_offset + nbytes);
        if (lo < hi) share.ranges.push_back({t, lo - source.byte_offset, hi - source.byte_offset});
      }
    }
  }
  for (const TensorByteRange& range : share.ranges) written[range.tensor] += static_cast<int64_t>(range.end - range.begin);
  std::vector<int64_t> total(tensors.size(), 0);
  world.all_reduce(written.data(), total.data(), static_cast<int64_t>(written.size()), DType::i64, ReduceOp::sum);
  for (size_t t = 0; t < tensors.size(); ++t) {
    CHECK(total[t] == static_cast<int64_t>(tensors[t].tensor.nbytes()), "save: the ranks would write ", total[t],
          " of the ", tensors[t].tensor.nbytes(), " bytes of '", tensors[t].name,
          "' (every byte must have exactly one writer); the parallel layout and the checkpoint disagree");
  }
  return share;
}

uint64_t bytes_sharing_storage(const std::vector<int64_t>& keys, const std::vector<int64_t>& bytes, int rank) {
  uint64_t sum = 0;
  for (size_t r = 0; r < keys.size(); ++r) {
    if (keys[r] == keys[static_cast<size_t>(rank)]) sum += static_cast<uint64_t>(bytes[r]);
  }
  return sum;
}

void check_save_space_on_ranks(Communicator& world, const std::string& output_dir, int64_t step, uint64_t my_bytes,
                               bool with_optimizer) {
  // Which ranks write to the same file system: those on the same host whose output_dir has the same
  // device number. Their bytes add up against one free space. Ranks on other hosts are not counted,
  // even when output_dir is a shared file system (NFS, Lustre), because from here a shared mount
  // cannot be told from node-local disks reliably; counting them would refuse saves that fit on
  // local disks. So on a shared file system over several hosts each host checks its own ranks'
  // bytes only: a save that does not fit can still get through this check, and then fails while
  // writing (ENOSPC), which the commit vote turns into a save that commits nothing and leaves the
  // previous checkpoints as they were. On one host (every CI and single-node job) the check is exact.
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  uint64_t key = 1469598103934665603ull;  // FNV-1a of the host name, then the device number
  for (const char* c = host; *c != 0; ++c) key = (key ^ static_cast<uint8_t>(*c)) * 1099511628211ull;
  struct stat info {};
  if (::stat(output_dir.c_str(), &info) == 0) key = (key ^ static_cast<uint64_t>(info.st_dev)) * 1099511628211ull;
  const int world_size = world.size();
  const int64_t mine[2] = {static_cast<int64_t>(key), static_cast<int64_t>(my_bytes)};
  std::vector<int64_t> all(static_cast<size_t>(2 * world_size));
  world.all_gather(mine, all.data(), 2, DType::i64);
  std::vector<int64_t> keys, bytes;
  for (int r = 0; r < world_size; ++r) {
    keys.push_back(all[static_cast<size_t>(2 * r)]);
    bytes.push_back(all[static_cast<size_t>(2 * r + 1)]);
  }
  const uint64_t needed = bytes_sharing_storage(keys, bytes, world.rank());
  const std::string problem = checkpoint_free_space_problem(output_dir, step, needed, with_optimizer);
  const int64_t failed = problem.empty() ? 0 : 1;
  int64_t any_failed = 0;
  world.all_reduce(&failed, &any_failed, 1, DType::i64, ReduceOp::max);
  CHECK(problem.empty(), problem, " (the bytes of the ", std::count(keys.begin(), keys.end(), keys[world.rank()]),
        " rank(s) writing to this file system)");
  CHECK(any_failed == 0, "save: checkpoint-", step, " was not written: another rank lacks disk space for its part ",
        "(its log says how much)");
}

}  // namespace deltamoe
