// Products whose one operand is fp32 (small per-token gate gradients, [T, 32] or [T, E]) and the
// other bf16, through a hi/lo bf16 split of the fp32 operand. The halves of every fp32 tensor of a
// product family are stacked as column blocks of one bf16 operand, so that one GEMM over them (K =
// the blocks' total width) replaces a GEMM per half: each of those read and wrote the whole fp32
// input gradient [T, C] again.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/gemm/gemm_cuda.h"

namespace deltamoe {

// hi = bf16(x), lo = bf16(x - hi) for `count` values: hi + lo equals x to ~2^-17 relative (each
// rounding keeps 8 significant bits), so a product of hi and lo with a bf16 operand, accumulated in
// fp32, is as exact as the bf16 operand itself allows. Why a split and not an fp32 kernel: the
// products reuse the cuBLASLt path tested in gemm_gpu_test.
void split_f32_to_bf16_hi_lo_cuda(const float* x, __nv_bfloat16* hi, __nv_bfloat16* lo, int64_t count,
                                  cudaStream_t stream);

// The same split of x [rows, cols] written as column blocks of packed [rows, ld]: hi at columns
// [hi_col, hi_col + cols), lo at [lo_col, lo_col + cols), and hi again at hi2_col when it is >= 0
// (for a product whose other operand is a hi/lo pair too). Blocks must not overlap.
void pack_f32_hi_lo_cuda(const float* x, int64_t rows, int64_t cols, __nv_bfloat16* packed, int64_t ld,
                         int64_t hi_col, int64_t lo_col, int64_t hi2_col, cudaStream_t stream);

// dst[i] = (dst[i] + a[i]) + b[i] in fp32 for i < count, the bf16 a and b widened: the bits of two
// adds in that order, in one pass (e.g. the routed and the shared experts' input gradients summed
// into the router's fp32 one).
void add_bf16_pair_to_f32_cuda(const __nv_bfloat16* a, const __nv_bfloat16* b, float* dst, int64_t count,
                               cudaStream_t stream);

}  // namespace deltamoe
