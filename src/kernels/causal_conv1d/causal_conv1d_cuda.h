// CUDA launchers of the causal depthwise conv1d + SiLU over packed sequences (the spec is
// causal_conv1d.h / causal_conv1d_ref.cc): bf16 activations and weight, fp32 math, fp32 dweight.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace deltamoe {

// Widest conv kernel the CUDA path supports (Qwen3.5 uses 4); the launchers CHECK against it.
constexpr int kCausalConv1dMaxKernel = 8;

// The conv's output y (forward) or its gradient dy (backward) [T, C] as up to three column blocks,
// each stored as its own dense rows: channels [0, width[0]) are part[0] [T, width[0]], the next
// width[1] channels part[1] [T, width[1]], and so on; the widths sum to C. The Gated DeltaNet
// reads its conv output this way (q | k | v, each a dense [T, H, D] tensor); one part of width C is
// the plain [T, C] layout.
template <typename Element>
struct CausalConv1dColumns {
  Element* part[3] = {nullptr, nullptr, nullptr};
  int64_t width[3] = {0, 0, 0};
};
using CausalConv1dOutput = CausalConv1dColumns<__nv_bfloat16>;
using CausalConv1dOutputGrad = CausalConv1dColumns<const __nv_bfloat16>;

// All pointers are device pointers. cu_seqlens [N+1] int32 on the device (not validated here:
// the data loader validated it on the host). Writes y [T, C] into its column parts.
void causal_conv1d_forward_cuda(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                const int32_t* cu_seqlens, int num_seqs, int64_t num_tokens,
                                int num_channels, int kernel_size, const CausalConv1dOutput& y,
                                cudaStream_t stream);

// Scratch of the backward: per-strip partial weight gradients.
size_t causal_conv1d_backward_workspace_bytes(int64_t num_tokens, int num_channels, int kernel_size);

// Given dy [T, C] (in its column parts): writes dx [T, C] (bf16) and ADDS the weight gradient to
// dweight [C, K] (fp32; null: frozen, not formed), summed over token strips in strip order
// (deterministic).
void causal_conv1d_backward_cuda(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                 const CausalConv1dOutputGrad& dy, const int32_t* cu_seqlens, int num_seqs,
                                 int64_t num_tokens, int num_channels, int kernel_size,
                                 __nv_bfloat16* dx, float* dweight, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream);

}  // namespace deltamoe
