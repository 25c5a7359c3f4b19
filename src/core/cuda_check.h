// CUDA_CHECK / CUBLAS_CHECK: every CUDA runtime and cuBLASLt call goes through one of these.
// Only included by files compiled with CUDA (DELTAMOE_WITH_CUDA).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/error.h"

#define CUDA_CHECK(call)                                                                      \
  do {                                                                                        \
    cudaError_t status_ = (call);                                                             \
    CHECK(status_ == cudaSuccess, #call, " failed: ", cudaGetErrorName(status_), " (",        \
          cudaGetErrorString(status_), ")");                                                  \
  } while (0)

// After a kernel launch: catches bad launch configurations immediately (no sync).
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

#define CUBLAS_CHECK(call)                                                                      \
  do {                                                                                          \
    cublasStatus_t status_ = (call);                                                            \
    CHECK(status_ == CUBLAS_STATUS_SUCCESS, #call, " failed: ", cublasLtGetStatusName(status_), \
          " (", cublasLtGetStatusString(status_), ")");                                         \
  } while (0)
