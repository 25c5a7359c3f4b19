// The one place a model picks its attention backend, once at setup: cuDNN's fused SDPA
// (cudnn_sdpa.h) with the sm_90a kernels (kernels/common/kernel_path_cuda.h) when cuDNN builds
// plans for the shape and they fit the workspace, our flash-attention kernel otherwise (and always
// on the sm_80 path: an A800, or a compute_80 build on the H200). DELTAMOE_ATTENTION=ours forces
// our kernel. The choice and its reason are logged.
//
// Reproducibility: cuDNN's backward accumulates dQ (and the grouped heads' dK/dV) with fp32
// atomics, so its gradients may differ in the last bits from run to run; our kernel's are
// bitwise reproducible. Runs and tests that need bitwise equal steps set DELTAMOE_ATTENTION=ours.
#pragma once

#include <cstddef>
#include <memory>

#include "kernels/cudnn_sdpa/gpu/cudnn_sdpa.h"

namespace deltamoe {

// Device workspace to plan for the cuDNN path: what its plans for `config` ask, found by building
// them once per process and configuration (cuDNN tells a plan's own scratch only once the plan
// exists). 0 where cuDNN will not be used: the sm_80 path, DELTAMOE_ATTENTION=ours, a shape cuDNN
// builds no plan for, or a need above kCudnnWorkspaceLimit.
size_t cudnn_attention_workspace_reserve(const CudnnSdpaConfig& config);

// The most step workspace the cuDNN path may ask; above it our kernel runs (and needs none). The
// workspace is memory the activations cannot have; 4 GiB is ~5% of an 80 GB GPU.
constexpr size_t kCudnnWorkspaceLimit = size_t{4} << 30;

// The cuDNN plans, or null for our kernel. `workspace_bytes` is what the caller's workspace holds
// (cudnn_attention_workspace_reserve(config) where it was planned); `who` names the model part in
// the log line.
std::unique_ptr<CudnnSdpa> choose_cudnn_attention(const CudnnSdpaConfig& config, size_t workspace_bytes,
                                                  const char* who);

}  // namespace deltamoe
