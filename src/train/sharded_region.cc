// Sizes and offsets of a ZeRO-2 rank's shared region (see the header).
#include "train/sharded_region.h"

#include <algorithm>
#include <vector>

namespace deltamoe {

namespace {

int64_t align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

int64_t ShardedRegion::bytes() const {
  const int64_t staging = bucket_f32_at + 4 * bucket_f32_elements;
  return std::max<int64_t>({4 * gradient_elements, staging, 4});
}

ShardedRegion plan_sharded_region(const ParallelLayout& layout,
                                  const std::function<bool(const std::string&)>& read_in_f32) {
  ShardedRegion region;
  const int world = layout.world();
  for (int g = 0; g < layout.num_groups(); ++g)
    region.gradient_elements = std::max(region.gradient_elements, layout.group_padded_elements(g));
  int64_t largest_run = 0;
  for (int b = 0; b < layout.num_buckets(); ++b) {
    region.piece_bf16_elements += layout.piece_elements(b);
    region.bucket_bf16_elements = std::max(region.bucket_bf16_elements, layout.piece_elements(b) * world);
    for (int r = 0; r < world; ++r) {
      int64_t run = 0;
      for (const ParallelLayout::Segment& segment : layout.piece_segments(b, r))
        if (read_in_f32(layout.full().entry(segment.full_entry).name)) run += segment.count;
      largest_run = std::max(largest_run, run);
    }
  }
  region.bucket_f32_elements = largest_run * world;
  region.piece_bf16_at = 0;
  region.bucket_bf16_at = align256(2 * region.piece_bf16_elements);
  region.bucket_f32_at = region.bucket_bf16_at + align256(2 * region.bucket_bf16_elements);
  return region;
}

}  // namespace deltamoe
