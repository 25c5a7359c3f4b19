// CUDNN_CHECK: every cuDNN call goes through it (CUDA builds only, beside CUDA_CHECK in
// core/cuda_check.h; its own header so that only cuDNN users need cudnn.h). The message names the
// call, the status and cuDNN's own last error text, which says which attribute or node it refused.
#pragma once

#include <cudnn.h>

#include <string>

#include "core/error.h"

namespace deltamoe {

// cuDNN's description of the last failure on this thread (empty when it kept none).
inline std::string cudnn_last_error() {
  char message[1024] = {0};
  cudnnGetLastErrorString(message, sizeof(message));
  return std::string(message);
}

}  // namespace deltamoe

#define CUDNN_CHECK(call)                                                                    \
  do {                                                                                       \
    cudnnStatus_t status_ = (call);                                                          \
    CHECK(status_ == CUDNN_STATUS_SUCCESS, #call, " failed: ", cudnnGetErrorString(status_), \
          " (", ::deltamoe::cudnn_last_error(), ")");                                        \
  } while (0)

// The same with a context string first (e.g. which graph node was being built).
#define CUDNN_CHECK_AT(where, call)                                                           \
  do {                                                                                        \
    cudnnStatus_t status_ = (call);                                                           \
    CHECK(status_ == CUDNN_STATUS_SUCCESS, where, ": ", #call, " failed: ",                   \
          cudnnGetErrorString(status_), " (", ::deltamoe::cudnn_last_error(), ")");           \
  } while (0)
