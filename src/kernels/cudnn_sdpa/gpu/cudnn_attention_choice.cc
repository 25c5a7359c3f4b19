// Attention backend choice at setup (cudnn_attention_choice.h).
#include "kernels/cudnn_sdpa/gpu/cudnn_attention_choice.h"

#include <cudnn.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/log.h"
#include "kernels/common/kernel_path_cuda.h"

namespace deltamoe {
namespace {

bool forced_ours() {
  const char* value = std::getenv("DELTAMOE_ATTENTION");
  return value != nullptr && std::string(value) == "ours";
}

}  // namespace

size_t cudnn_attention_workspace_reserve(const CudnnSdpaConfig& config) {
  if (forced_ours() || !sm90a_kernels_usable()) return 0;
  return CudnnSdpa::fixed_workspace_bytes(config) + kCudnnPlanWorkspaceAllowance;
}

std::unique_ptr<CudnnSdpa> choose_cudnn_attention(const CudnnSdpaConfig& config, size_t workspace_bytes,
                                                  const char* who) {
  if (forced_ours()) {
    log_info(who, ": our flash-attention kernel (DELTAMOE_ATTENTION=ours)");
    return nullptr;
  }
  std::string why_not;
  std::unique_ptr<CudnnSdpa> sdpa = CudnnSdpa::create(config, &why_not);
  if (sdpa == nullptr) {
    log_info(who, ": our flash-attention kernel; ", why_not);
    return nullptr;
  }
  const size_t needed = std::max(sdpa->forward_workspace_bytes(), sdpa->backward_workspace_bytes());
  if (needed > workspace_bytes) {
    log_warn(who, ": our flash-attention kernel; cuDNN SDPA needs ", needed, " bytes of workspace, ", workspace_bytes,
             " were planned");
    return nullptr;
  }
  log_info(who, ": cuDNN fused SDPA (cuDNN ", cudnnGetVersion(), ", plans for up to ", config.max_tokens,
           " tokens in ", config.max_segments, " sequences, workspace ", needed, " bytes)");
  return sdpa;
}

}  // namespace deltamoe
