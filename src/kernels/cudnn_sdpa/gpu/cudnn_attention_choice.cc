// Attention backend choice at setup (cudnn_attention_choice.h).
#include "kernels/cudnn_sdpa/gpu/cudnn_attention_choice.h"

#include <cudnn.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "core/cuda_check.h"
#include "core/log.h"
#include "kernels/common/kernel_path_cuda.h"

namespace deltamoe {
namespace {

bool forced_ours() {
  const char* value = std::getenv("DELTAMOE_ATTENTION");
  return value != nullptr && std::string(value) == "ours";
}

size_t workspace_need(const CudnnSdpa& sdpa) {
  return std::max(sdpa.forward_workspace_bytes(), sdpa.backward_workspace_bytes());
}

}  // namespace

size_t cudnn_attention_workspace_reserve(const CudnnSdpaConfig& config) {
  if (forced_ours() || !sm90a_kernels_usable()) return 0;
  // The memory planner asks for the same configurations many times while it weighs its choices:
  // the plans are built once per (device, configuration) and only their need is kept.
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, float, int64_t, bool>;
  static std::mutex mutex;
  static std::map<Key, size_t> needs;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const Key key{device,          config.max_tokens,          config.max_segments,  config.num_q_heads,
                config.num_kv_heads, config.head_dim,        config.value_dim,     config.causal,
                config.scale,        config.max_sequence_tokens, config.sequence_plans};
  std::lock_guard<std::mutex> lock(mutex);
  auto found = needs.find(key);
  if (found == needs.end()) {
    std::string why_not;
    const std::unique_ptr<CudnnSdpa> sdpa = CudnnSdpa::create(config, &why_not);
    const size_t need = sdpa == nullptr ? 0 : workspace_need(*sdpa);
    found = needs.emplace(key, need <= kCudnnWorkspaceLimit ? need : 0).first;
  }
  return found->second;
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
  const size_t needed = workspace_need(*sdpa);
  if (needed > kCudnnWorkspaceLimit) {
    log_info(who, ": our flash-attention kernel; cuDNN SDPA would take ", needed, " bytes of workspace (",
             config.max_segments, " sequences a micro-batch), over the ", kCudnnWorkspaceLimit, " bytes it may have");
    return nullptr;
  }
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
