// The one device region a ZeRO-2 rank of the GPU engine reuses for its dense gradients and its
// weight all-gather (device_train_state.h). During the backward it holds one gradient group at a
// time (the largest group sets its size); at the step end, when every group has been reduced and the
// region is idle, it stages the all-gather: this rank's updated bf16 pieces of every bucket, one
// gathered bf16 bucket, and the gathered fp32 values of the tensors read in fp32. The planner and the
// engine size it with this one function.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "train/parallel_layout.h"

namespace deltamoe {

struct ShardedRegion {
  int64_t gradient_elements = 0;  // fp32: the largest group's padded buckets
  int64_t piece_bf16_elements = 0;  // bf16: every bucket's own piece, back to back
  int64_t bucket_bf16_elements = 0;  // bf16: the largest bucket, world x piece
  int64_t bucket_f32_elements = 0;   // fp32: world x the largest fp32-read run of one rank's piece
  // Byte offsets of the staging parts in the region (256-byte aligned).
  int64_t piece_bf16_at = 0, bucket_bf16_at = 0, bucket_f32_at = 0;
  int64_t bytes() const;  // the region: the larger of the gradients and the staging
};

// read_in_f32(name): the tensor keeps an fp32 working copy that the all-gather refreshes.
ShardedRegion plan_sharded_region(const ParallelLayout& layout, const std::function<bool(const std::string&)>& read_in_f32);

}  // namespace deltamoe
