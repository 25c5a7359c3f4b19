// ParamLayout bookkeeping: offsets with alignment padding, the decay rule, shard ranges.
#include "optim/param_layout.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace deltamoe {

int ParamLayout::add(const std::string& name, const std::vector<int64_t>& shape) {
  return add(name, shape, default_decay(shape));
}

int64_t ParamEntry::tensor_numel() const {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  return count;
}

int ParamLayout::add(const std::string& name, const std::vector<int64_t>& shape, bool decay) {
  CHECK(!name.empty(), "ParamLayout::add: a parameter needs a name");
  CHECK(find(name) < 0, "ParamLayout::add: parameter '", name, "' was added twice");
  for (int64_t dim : shape) CHECK(dim >= 0, "ParamLayout::add: parameter '", name, "' has a negative dimension ", dim);
  ParamEntry entry;
  entry.name = name;
  entry.shape = shape;
  entry.numel = entry.tensor_numel();
  entry.decay = decay;
  return append(std::move(entry));
}

int ParamLayout::add_piece(const std::string& name, const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  CHECK(!name.empty(), "ParamLayout::add_piece: a parameter needs a name");
  for (int64_t dim : shape) CHECK(dim >= 0, "ParamLayout::add_piece: parameter '", name, "' has a negative dimension ", dim);
  ParamEntry entry;
  entry.name = name;
  entry.shape = shape;
  const int64_t numel = entry.tensor_numel();
  CHECK(begin >= 0 && begin < end && end <= numel, "ParamLayout::add_piece: elements [", begin, ", ", end, ") of '",
        name, "' are not a non-empty range inside its ", numel, " elements");
  for (const ParamEntry& other : entries_) {
    if (other.name != name) continue;
    CHECK(other.shape == shape, "ParamLayout::add_piece: pieces of '", name, "' disagree on its shape");
    CHECK(end <= other.tensor_begin || begin >= other.tensor_begin + other.numel, "ParamLayout::add_piece: elements [",
          begin, ", ", end, ") of '", name, "' overlap a piece added before");
  }
  entry.tensor_begin = begin;
  entry.numel = end - begin;
  entry.decay = default_decay(shape);
  return append(std::move(entry));
}

int ParamLayout::append(ParamEntry entry) {
  entry.offset = (total_numel_ + kFlatAlignmentElements - 1) / kFlatAlignmentElements * kFlatAlignmentElements;
  total_numel_ = entry.offset + entry.numel;
  const int index = static_cast<int>(entries_.size());
  first_piece_.emplace(entry.name, index);
  entries_.push_back(std::move(entry));
  return index;
}

void ParamLayout::set_lr_scale(int index, double lr_scale) {
  CHECK(lr_scale >= 0 && std::isfinite(lr_scale), "learning-rate multiplier of '", entry(index).name,
        "' must be a non-negative number, got ", lr_scale);
  entries_[static_cast<size_t>(index)].lr_scale = lr_scale;
}

const ParamEntry& ParamLayout::entry(int index) const {
  CHECK(index >= 0 && index < num_tensors(), "ParamLayout::entry: index ", index, " outside [0, ",
        num_tensors(), ")");
  return entries_[static_cast<size_t>(index)];
}

int ParamLayout::find(const std::string& name) const {
  const auto it = first_piece_.find(name);
  return it == first_piece_.end() ? -1 : it->second;
}

int64_t ParamLayout::num_parameters() const {
  int64_t count = 0;
  for (const ParamEntry& entry : entries_) count += entry.numel;
  return count;
}

FlatRange shard_range(int64_t total_numel, int shard_idx, int num_shards) {
  CHECK(num_shards > 0, "shard_range: num_shards must be positive, got ", num_shards);
  CHECK(shard_idx >= 0 && shard_idx < num_shards, "shard_range: shard ", shard_idx, " outside [0, ",
        num_shards, ")");
  CHECK(total_numel >= 0, "shard_range: negative total_numel ", total_numel);
  const int64_t base = total_numel / num_shards;
  const int64_t extra = total_numel % num_shards;
  const int64_t begin = shard_idx * base + std::min<int64_t>(shard_idx, extra);
  const int64_t size = base + (shard_idx < extra ? 1 : 0);
  return {begin, begin + size};
}

}  // namespace deltamoe
