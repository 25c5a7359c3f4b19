// Device-side filling of parameter buffers by the parameter table's init rules (random weights for
// the benchmark: 7+ billion parameters would take minutes on the host) and the fp32 -> bf16
// working copy.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "model/param_table.h"

namespace deltamoe {

// master[i] = mean + std * normal(seed, stream_id, first + i) for i < count; the value depends only
// on (seed, stream_id, first + i), so a tensor's values do not depend on the launch shape, and a
// slice of it (first: the slice's first element, e.g. a rank's own experts) gets the whole
// tensor's values.
void fill_normal_cuda(float* master, int64_t count, float mean, float std, uint64_t seed, uint64_t stream_id,
                      cudaStream_t stream, int64_t first = 0);
// out[0, count) by `init` (model/param_table.h): normal(0, std), zeros, ones, or log(U(0.01, 16));
// values depend only on (seed, stream_id, first + i).
void init_param_cuda(InitKind init, float std, float* out, int64_t count, uint64_t seed, uint64_t stream_id,
                     cudaStream_t stream, int64_t first = 0);
// out[i] = bf16(in[i]) (round to nearest even), i < count.
void convert_f32_to_bf16_cuda(const float* in, __nv_bfloat16* out, int64_t count, cudaStream_t stream);

}  // namespace deltamoe
