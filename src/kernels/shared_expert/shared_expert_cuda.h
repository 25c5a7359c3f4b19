// CUDA shared expert with its sigmoid gate (the spec is shared_expert.h): dense products through
// cuBLAS (bf16 operands, fp32 accumulation), SiLU gate and scaling kernels in fp32.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace deltamoe {

size_t shared_expert_forward_workspace_bytes(int64_t num_tokens, int64_t hidden, int64_t intermediate);
size_t shared_expert_backward_workspace_bytes(int64_t num_tokens, int64_t hidden, int64_t intermediate);

// x [T, C]; gate_proj, up_proj [I, C]; down_proj [C, I]; expert_gate [1, C]; all bf16.
// y [T, C] bf16 written (accumulate false) or added to (true: y = routed + shared, summed in fp32).
void shared_expert_forward_cuda(cublasHandle_t handle, const __nv_bfloat16* x, const __nv_bfloat16* gate_proj,
                                const __nv_bfloat16* up_proj, const __nv_bfloat16* down_proj,
                                const __nv_bfloat16* expert_gate, __nv_bfloat16* y, bool accumulate, int64_t num_tokens,
                                int64_t hidden, int64_t intermediate, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream);

// dy [T, C] bf16 -> dx [T, C] bf16 written (accumulate_dx false) or added to; d_gate_proj,
// d_up_proj [I, C], d_down_proj [C, I], d_expert_gate [1, C] f32 added to (each may be null: a
// frozen weight, its product skipped). Recomputes activations.
void shared_expert_backward_cuda(cublasHandle_t handle, const __nv_bfloat16* x, const __nv_bfloat16* gate_proj,
                                 const __nv_bfloat16* up_proj, const __nv_bfloat16* down_proj,
                                 const __nv_bfloat16* expert_gate, const __nv_bfloat16* dy, __nv_bfloat16* dx,
                                 bool accumulate_dx, float* d_gate_proj, float* d_up_proj, float* d_down_proj,
                                 float* d_expert_gate, int64_t num_tokens, int64_t hidden, int64_t intermediate,
                                 void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace deltamoe
