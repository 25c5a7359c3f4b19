// CUDA launchers of the gated RMSNorm of the GDN output (spec: gated_rmsnorm.h):
// y = o * rsqrt(mean(o^2) + eps) * w * silu(z); bf16 tensors, the fp32 weight read from the master
// copy (as bf16 autocast keeps it), fp32 math and fp32 dweight.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe {

// o, z, y [R, D] bf16, weight [D] f32 (device pointers). Writes y.
void gated_rmsnorm_forward_cuda(const __nv_bfloat16* o, const __nv_bfloat16* z,
                                const float* weight, int64_t num_rows, int dim, float eps,
                                __nv_bfloat16* y, cudaStream_t stream);

// Scratch of the backward (per-block partial sums of dweight).
size_t gated_rmsnorm_backward_workspace_bytes(int64_t num_rows, int dim);

// Given dy [R, D]: writes d_o, dz [R, D] bf16 and ADDS to dweight [D] fp32 (null: frozen, not
// formed), summed in a fixed order (deterministic). D <= 1024.
void gated_rmsnorm_backward_cuda(const __nv_bfloat16* o, const __nv_bfloat16* z,
                                 const float* weight, const __nv_bfloat16* dy,
                                 int64_t num_rows, int dim, float eps, __nv_bfloat16* d_o,
                                 __nv_bfloat16* dz, float* dweight, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream);

}  // namespace deltamoe
