// CUDA launchers of the l2 normalisation of the GDN queries and keys (spec: l2norm.h):
// y = x * rsqrt(sum(x^2) + 1e-6) per row, bf16 in and out, fp32 sums.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe {

// x, y [R, D] device pointers, D <= 1024 (one warp holds a row). Writes y.
void l2norm_forward_cuda(const __nv_bfloat16* x, int64_t num_rows, int dim, __nv_bfloat16* y,
                         cudaStream_t stream);

// Given dy [R, D]: writes dx [R, D] (the norm is recomputed from x).
void l2norm_backward_cuda(const __nv_bfloat16* x, const __nv_bfloat16* dy, int64_t num_rows,
                          int dim, __nv_bfloat16* dx, cudaStream_t stream);

}  // namespace deltamoe
