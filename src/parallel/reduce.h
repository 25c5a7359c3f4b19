// Element-wise reductions used by every host communicator backend, and the one order they run in.
// All backends reduce with these functions in rank order (rank 0, then 1, ...), so a result is
// bitwise the same whichever backend or world layout produced it.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/dtype.h"

namespace deltamoe {

enum class ReduceOp : uint8_t { sum, max };

std::string_view reduce_op_name(ReduceOp op);

// Whether `op` is defined for `dtype`: sum and max for f32, f64, bf16, f16, i32, i64; max only for
// u8 and bool (max of bools is their logical or).
bool reduce_supported(DType dtype, ReduceOp op);

// acc[i] = acc[i] op x[i] for i in [0, count). Arithmetic, per element type:
//   f32, f64     IEEE addition in that type (no fused or reordered operations);
//   bf16, f16    both operands widened to f32, added in f32, rounded to the type (nearest even)
//                at every step, the way NCCL reduces 16-bit floats;
//   i32, i64     two's-complement addition that wraps on overflow;
//   max          the larger value; a NaN operand gives NaN (acc's NaN if both are NaN).
// A rank-ordered reduction is: copy rank 0's values into acc, then reduce_into(acc, x_r) for
// r = 1, 2, ... in that order. Throws when reduce_supported(dtype, op) is false.
void reduce_into(void* acc, const void* x, int64_t count, DType dtype, ReduceOp op);

}  // namespace deltamoe
