// Bucketing of the dense elements and the pieces each rank owns (see the header).
#include "train/parallel_layout.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace deltamoe {

bool is_routed_expert_tensor(const std::string& name) {
  return name.find(".mlp.experts.gate_up_proj") != std::string::npos ||
         name.find(".mlp.experts.down_proj") != std::string::npos;
}

ParallelLayout::ParallelLayout(const ParamLayout& full, int rank, int world, int64_t num_experts,
                               const ParallelOptions& options)
    : full_(full), rank_(rank), world_(world), ep_(options.expert_parallel_size) {
  CHECK(world >= 1 && rank >= 0 && rank < world, "parallel layout: rank ", rank, " of ", world);
  CHECK(ep_ >= 1 && world % ep_ == 0, "--expert_model_parallel_size ", ep_, " must divide the ", world, " ranks");
  CHECK(world == 1 || options.distributed_optimizer, "training on ", world,
        " ranks needs --use_distributed_optimizer true (ZeRO-2 for the dense parameters); replicated optimizer "
        "state is not implemented");
  CHECK(options.bucket_elements > 0, "parallel layout: bucket_elements must be positive");
  if (ep_ > 1) {
    CHECK(num_experts % ep_ == 0, "--expert_model_parallel_size ", ep_, " does not divide the ", num_experts,
          " routed experts of each layer");
    experts_per_rank_ = num_experts / ep_;
  }
  dense_stream_.push_back(0);
  for (int i = 0; i < full.num_tensors(); ++i) {
    const ParamEntry& entry = full.entry(i);
    CHECK(entry.is_whole_tensor(), "parallel layout: '", entry.name, "' must be whole in the full layout");
    if (ep_ > 1 && is_routed_expert_tensor(entry.name)) {
      CHECK(!entry.shape.empty() && entry.shape[0] == num_experts, "parallel layout: '", entry.name,
            "' does not lead with the ", num_experts, " experts");
      const int64_t per_expert = entry.numel / num_experts;
      const int index = state_.add_piece(entry.name, entry.shape, first_local_expert() * per_expert,
                                         (first_local_expert() + experts_per_rank_) * per_expert);
      state_.set_lr_scale(index, entry.lr_scale);
      expert_pieces_.emplace_back(index, i);
      continue;
    }
    dense_entries_.push_back(i);
    dense_stream_.push_back(dense_stream_.back() + entry.numel);
  }
  for (const auto& [state_index, full_index] : expert_pieces_) {
    dense_state_begin_ = std::max(dense_state_begin_, state_.entry(state_index).offset + state_.entry(state_index).numel);
  }
  const int64_t dense_total = dense_stream_.back();
  for (int64_t begin = 0; begin < dense_total; begin += options.bucket_elements) bucket_begin_.push_back(begin);
  bucket_begin_.push_back(dense_total);
  own_piece_state_.resize(static_cast<size_t>(num_buckets()));
  for (int b = 0; b < num_buckets(); ++b) {
    for (const Segment& segment : piece_segments(b, rank_)) {
      const ParamEntry& entry = full.entry(segment.full_entry);
      const int index =
          state_.add_piece(entry.name, entry.shape, segment.tensor_begin, segment.tensor_begin + segment.count);
      state_.set_lr_scale(index, entry.lr_scale);
      own_piece_state_[b].emplace_back(state_.entry(index).offset, segment.count);
    }
  }
}

int64_t ParallelLayout::piece_elements(int bucket) const {
  const int64_t size = bucket_begin_[bucket + 1] - bucket_begin_[bucket];
  return (size + world_ - 1) / world_;
}

std::vector<ParallelLayout::Segment> ParallelLayout::stream_segments(int64_t begin, int64_t end) const {
  std::vector<Segment> segments;
  // First dense tensor whose stream range ends after `begin`.
  size_t i = std::upper_bound(dense_stream_.begin(), dense_stream_.end(), begin) - dense_stream_.begin() - 1;
  for (; i < dense_entries_.size() && dense_stream_[i] < end; ++i) {
    const int64_t lo = std::max(begin, dense_stream_[i]), hi = std::min(end, dense_stream_[i + 1]);
    if (lo >= hi) continue;
    const ParamEntry& entry = full_.entry(dense_entries_[i]);
    segments.push_back({dense_entries_[i], lo - dense_stream_[i], hi - lo, entry.offset + (lo - dense_stream_[i])});
  }
  return segments;
}

std::vector<ParallelLayout::Segment> ParallelLayout::piece_segments(int bucket, int piece_rank) const {
  const int64_t piece = piece_elements(bucket);
  const int64_t begin = std::min(bucket_begin_[bucket] + piece_rank * piece, bucket_begin_[bucket + 1]);
  const int64_t end = std::min(begin + piece, bucket_begin_[bucket + 1]);
  return stream_segments(begin, end);
}

void ParallelLayout::pack_bucket(int bucket, const float* full, float* padded) const {
  const int64_t total = piece_elements(bucket) * world_;
  float* out = padded;
  for (const Segment& segment : stream_segments(bucket_begin_[bucket], bucket_begin_[bucket + 1])) {
    std::memcpy(out, full + segment.full_offset, static_cast<size_t>(segment.count) * sizeof(float));
    out += segment.count;
  }
  std::fill(out, padded + total, 0.0f);
}

}  // namespace deltamoe
