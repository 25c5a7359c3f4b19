// Clipping by the global L2 norm of all gradients (torch.nn.utils.clip_grad_norm_), with fp64
// accumulation, and the policy for a non-finite norm: report it and skip the optimizer step.
#pragma once

#include <cstdint>

namespace deltamoe {

// Sum of squares of count fp32 values, accumulated in fp64. With a sharded optimizer each rank
// computes this over its shard and the ranks sum the partials (then take the square root), so
// the norm does not depend on how the buffer is split beyond fp64 rounding.
double sum_of_squares_f64(const float* values, int64_t count);

struct GradClipResult {
  double grad_norm = 0;     // the global norm before clipping (logged every step)
  float clip_coef = 1.0f;   // factor the gradients were multiplied by (1 when not clipped)
  bool finite = true;       // false: the norm is inf or NaN and the step must be skipped
  bool clipped() const { return clip_coef < 1.0f; }
};

// clip_coef = min(1, max_norm / (norm + 1e-6)). torch computes it in fp32 from an fp32 norm; we
// compute it in fp64 and round once to fp32, which can differ from torch by one ulp. max_norm <= 0 disables clipping (coef 1) but the norm is still reported.
// A non-finite norm gives finite = false and coef 1: the caller skips the update (see
// docs/optimizer.md) instead of multiplying the gradients by NaN.
GradClipResult grad_clip_from_sum_of_squares(double sum_of_squares, double max_norm);

// Whole-buffer convenience: computes the norm of grad[0, count), scales grad in place by
// clip_coef when it is < 1 and the norm is finite, and returns the result.
GradClipResult clip_grad_norm(float* grad, int64_t count, double max_norm);

// Multiplies count values by coef (the second half of clipping once the global norm is known).
void scale_in_place(float* values, int64_t count, float coef);

}  // namespace deltamoe
