// The per-call batch arrays of the cuDNN SDPA plans (cudnn_sdpa.h): sequence lengths and ragged
// element offsets derived from cu_seqlens on the device, so no host sync and no plan per packing.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/cudnn_sdpa/gpu/cudnn_sdpa.h"

namespace deltamoe {
namespace {

__global__ void batch_arrays_kernel(const int32_t* __restrict__ cu, int32_t n, int32_t max_n, int32_t q_stride,
                                    int32_t kv_stride, int32_t stats_stride, int32_t* __restrict__ seq_len,
                                    int32_t* __restrict__ q_offsets, int32_t* __restrict__ kv_offsets,
                                    int32_t* __restrict__ stats_offsets) {
  for (int32_t i = threadIdx.x; i <= max_n; i += blockDim.x) {
    const int32_t start = cu[i < n ? i : n];
    if (i < max_n) seq_len[i] = i < n ? cu[i + 1] - start : 0;
    q_offsets[i] = start * q_stride;
    kv_offsets[i] = start * kv_stride;
    stats_offsets[i] = start * stats_stride;
  }
}

}  // namespace

void cudnn_sdpa_batch_arrays_cuda(const int32_t* cu_seqlens, int64_t num_segments, int64_t max_segments,
                                  int64_t q_stride, int64_t kv_stride, int64_t stats_stride, int32_t* seq_len,
                                  int32_t* q_offsets, int32_t* kv_offsets, int32_t* stats_offsets,
                                  cudaStream_t stream) {
  CHECK(num_segments >= 1 && num_segments <= max_segments, "cudnn_sdpa: ", num_segments,
        " sequences, the plan holds 1..", max_segments);
  batch_arrays_kernel<<<1, 256, 0, stream>>>(cu_seqlens, static_cast<int32_t>(num_segments),
                                             static_cast<int32_t>(max_segments), static_cast<int32_t>(q_stride),
                                             static_cast<int32_t>(kv_stride), static_cast<int32_t>(stats_stride),
                                             seq_len, q_offsets, kv_offsets, stats_offsets);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
