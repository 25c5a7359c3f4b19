// The per-call batch arrays of the cuDNN SDPA plans (cudnn_sdpa.h): sequence lengths and ragged
// element offsets derived from cu_seqlens on the device, so no host sync and no plan per packing.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/cudnn_sdpa/gpu/cudnn_sdpa.h"

namespace deltamoe {
namespace {

struct OffsetArrays {
  int32_t row_elements[kCudnnSdpaOffsetArrays];
  int32_t* offsets[kCudnnSdpaOffsetArrays];
};

__global__ void batch_arrays_kernel(const int32_t* __restrict__ cu, int32_t n, int32_t max_n,
                                    int32_t* __restrict__ seq_len, OffsetArrays arrays) {
  for (int32_t i = threadIdx.x; i <= max_n; i += blockDim.x) {
    const int32_t start = cu[i < n ? i : n];
    if (i < max_n) seq_len[i] = i < n ? cu[i + 1] - start : 0;
#pragma unroll
    for (int k = 0; k < kCudnnSdpaOffsetArrays; ++k) arrays.offsets[k][i] = start * arrays.row_elements[k];
  }
}

}  // namespace

void cudnn_sdpa_batch_arrays_cuda(const int32_t* cu_seqlens, int64_t num_segments, int64_t max_segments,
                                  const std::array<int64_t, kCudnnSdpaOffsetArrays>& row_elements, int32_t* seq_len,
                                  const std::array<int32_t*, kCudnnSdpaOffsetArrays>& offsets, cudaStream_t stream) {
  CHECK(num_segments >= 1 && num_segments <= max_segments, "cudnn_sdpa: ", num_segments,
        " sequences, the plan holds 1..", max_segments);
  OffsetArrays arrays{};
  for (int k = 0; k < kCudnnSdpaOffsetArrays; ++k) {
    arrays.row_elements[k] = static_cast<int32_t>(row_elements[k]);
    arrays.offsets[k] = offsets[k];
  }
  batch_arrays_kernel<<<1, 256, 0, stream>>>(cu_seqlens, static_cast<int32_t>(num_segments),
                                             static_cast<int32_t>(max_segments), seq_len, arrays);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
