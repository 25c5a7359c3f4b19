// Rank 0 collects every rank's pieces: first their descriptions (full entry, first element, count),
// then per piece the master and both moments as bytes.
#include "train/gathered_state.h"

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace deltamoe {

std::unique_ptr<HostTrainState> gather_train_state(Communicator& world, const TrainStateStore& mine,
                                                   const ParamLayout& full) {
  const ParamLayout& layout = mine.layout();
  const AdamWConfig& config = mine.adamw_config();
  // (full entry, tensor_begin, numel) per piece.
  std::vector<int64_t> pieces;
  for (const ParamEntry& entry : layout.entries()) {
    const int index = full.find(entry.name);
    CHECK(index >= 0, "gather state: '", entry.name, "' is not in the full layout");
    pieces.insert(pieces.end(), {index, entry.tensor_begin, entry.numel});
  }
  const int world_size = world.size();
  std::vector<int64_t> counts(static_cast<size_t>(world_size));
  const int64_t my_count = static_cast<int64_t>(pieces.size());
  world.all_gather(&my_count, counts.data(), 1, DType::i64);
  std::unique_ptr<HostTrainState> gathered;
  std::vector<std::vector<int64_t>> descriptions(static_cast<size_t>(world_size));
  if (world.rank() == 0) {
    gathered = std::make_unique<HostTrainState>(full, config);
    gathered->set_adam_step(mine.adam_step());
  }
  world.group_start();
  if (world.rank() == 0) {
    for (int r = 0; r < world_size; ++r) {
      descriptions[r].resize(static_cast<size_t>(counts[r]));
      world.recv(descriptions[r].data(), counts[r], DType::i64, r);
    }
  }
  world.send(pieces.data(), my_count, DType::i64, 0);
  world.group_end();

  std::vector<uint8_t> bytes;
  // Rank 0: the element ranges of each full entry received (replicas of an expert block send the
  // same range: identical values).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> covered;
  if (world.rank() == 0) covered.resize(static_cast<size_t>(full.num_tensors()));
  for (const StateKind kind : kStateKinds) {
    const size_t element = dtype_size(state_dtype(kind, config));
    // Each rank sends its pieces in order; rank 0 receives rank after rank straight into place.
    std::vector<std::vector<uint8_t>> outgoing(static_cast<size_t>(layout.num_tensors()));
    for (int i = 0; i < layout.num_tensors(); ++i) {
      outgoing[i].resize(static_cast<size_t>(layout.entry(i).numel) * element);
      mine.read_state(kind, i, 0, layout.entry(i).numel, outgoing[i].data());
    }
    std::vector<std::vector<uint8_t>> incoming;
    world.group_start();
    if (world.rank() == 0) {
      for (int r = 0; r < world_size; ++r) {
        for (int64_t p = 0; p + 2 < counts[r]; p += 3) {
          incoming.emplace_back(static_cast<size_t>(descriptions[r][p + 2]) * element);
          world.recv(incoming.back().data(), static_cast<int64_t>(incoming.back().size()), DType::u8, r);
        }
      }
    }
    for (const auto& piece : outgoing) world.send(piece.data(), static_cast<int64_t>(piece.size()), DType::u8, 0);
    world.group_end();
    if (world.rank() != 0) continue;
    size_t next = 0;
    for (int r = 0; r < world_size; ++r) {
      for (int64_t p = 0; p + 2 < counts[r]; p += 3) {
        const int index = static_cast<int>(descriptions[r][p]);
        const int64_t begin = descriptions[r][p + 1], count = descriptions[r][p + 2];
        CHECK(index >= 0 && index < full.num_tensors() && begin >= 0 && begin + count <= full.entry(index).numel,
              "gather state: rank ", r, " sent a piece outside the full layout");
        gathered->write_state(kind, index, begin, count, incoming[next++].data());
        if (kind == StateKind::master) covered[index].emplace_back(begin, begin + count);
      }
    }
  }
  if (world.rank() == 0) {
    for (int i = 0; i < full.num_tensors(); ++i) {
      std::sort(covered[i].begin(), covered[i].end());
      int64_t reached = 0;
      for (const auto& [begin, end] : covered[i]) {
        CHECK(begin <= reached, "gather state: no rank holds elements [", reached, ", ", begin, ") of '",
              full.entry(i).name, "'");
        reached = std::max(reached, end);
      }
      CHECK(reached == full.entry(i).numel, "gather state: no rank holds elements [", reached, ", ",
            full.entry(i).numel, ") of '", full.entry(i).name, "'");
    }
  }
  return gathered;
}

}  // namespace deltamoe
