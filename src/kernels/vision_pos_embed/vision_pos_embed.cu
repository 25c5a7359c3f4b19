// CUDA position-embedding interpolation: forward as a 4-tap gather per patch, backward as a gather
// per table row over the inverted taps (chosen over atomics so that the fp32 table gradient is the
// same every run).
#include <algorithm>
#include <limits>
#include <vector>

#include "core/cuda_check.h"
#include "kernels/gemm/bf16_vector.cuh"
#include "kernels/vision_pos_embed/vision_pos_embed_cuda.h"

namespace deltamoe {
namespace {

constexpr int kThreads = 256;

// blockIdx.x: the patch; blockIdx.y: a slice of blockDim.x * kVec columns.
template <int kVec>
__global__ void pos_embed_forward_kernel(const float* table, const int64_t* index, const float* weight,
                                         const __nv_bfloat16* in, float* out, int64_t hidden) {
  const int64_t n = blockIdx.x;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * kVec;
  if (c >= hidden) return;
  float acc[kVec];
  load_as_f32<kVec>(in + n * hidden + c, acc);
  float sum[kVec] = {};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float w = weight[n * 4 + k];
    float row[kVec];
    load_as_f32<kVec>(table + index[n * 4 + k] * hidden + c, row);
#pragma unroll
    for (int i = 0; i < kVec; ++i) sum[i] += w * row[i];
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) acc[i] += sum[i];
  store_from_f32<kVec>(out + n * hidden + c, acc);
}

// blockIdx.x: the table row g; blockIdx.y: a column slice. d_table[g, c] += sum over its taps, in list order.
__global__ void pos_embed_backward_kernel(const float* d_out, const float* weight,
                                          const int32_t* row_offsets, const int32_t* entries, float* d_table,
                                          int64_t hidden) {
  const int64_t g = blockIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x;
  if (c >= hidden) return;
  const int32_t begin = row_offsets[g], end = row_offsets[g + 1];
  float acc = 0;
  for (int32_t e = begin; e < end; ++e) {
    const int32_t slot = entries[e];
    acc += weight[slot] * d_out[static_cast<int64_t>(slot / 4) * hidden + c];
  }
  d_table[g * hidden + c] += acc;
}

}  // namespace

void vision_pos_embed_invert_taps(const int64_t* index, int64_t num_patches, int64_t table_rows,
                                  int32_t* row_offsets, int32_t* entries) {
  CHECK(num_patches >= 0 && table_rows > 0, "vision_pos_embed_invert_taps: bad size patches ", num_patches,
        ", table rows ", table_rows);
  CHECK(num_patches * 4 <= std::numeric_limits<int32_t>::max(), "vision_pos_embed_invert_taps: ", num_patches,
        " patches overflow the int32 tap list");
  std::fill(row_offsets, row_offsets + table_rows + 1, 0);
  for (int64_t slot = 0; slot < num_patches * 4; ++slot) {
    CHECK(index[slot] >= 0 && index[slot] < table_rows, "vision_pos_embed_invert_taps: patch ", slot / 4, " tap ",
          slot % 4, " reads table row ", index[slot], ", outside the ", table_rows, "-row table");
    ++row_offsets[index[slot] + 1];
  }
  for (int64_t g = 0; g < table_rows; ++g) row_offsets[g + 1] += row_offsets[g];
  // Counting sort: slots visited in increasing order keep each row's list increasing.
  std::vector<int32_t> next(row_offsets, row_offsets + table_rows);
  for (int64_t slot = 0; slot < num_patches * 4; ++slot) entries[next[index[slot]]++] = static_cast<int32_t>(slot);
}

void vision_pos_embed_forward_cuda(const float* table, const int64_t* index, const float* weight,
                                   const __nv_bfloat16* in, float* out, int64_t num_patches, int64_t hidden,
                                   cudaStream_t stream) {
  CHECK(num_patches >= 0 && hidden > 0, "vision_pos_embed_forward_cuda: bad size patches ", num_patches, ", hidden ",
        hidden);
  if (num_patches == 0) return;
  const bool vec8 = can_use_vec8(hidden, table, in, out);
  const int64_t vectors = vec8 ? hidden / 8 : hidden;
  // A block as wide as the row's vectors (up to kThreads), so that 1152 columns leave few idle lanes.
  const int64_t threads = std::min<int64_t>(kThreads, (vectors + 31) / 32 * 32);
  const dim3 grid(static_cast<unsigned>(num_patches), static_cast<unsigned>((vectors + threads - 1) / threads));
  if (vec8) {
    pos_embed_forward_kernel<8><<<grid, static_cast<unsigned>(threads), 0, stream>>>(table, index, weight, in, out,
                                                                                   hidden);
  } else {
    pos_embed_forward_kernel<1><<<grid, static_cast<unsigned>(threads), 0, stream>>>(table, index, weight, in, out,
                                                                                   hidden);
  }
  CUDA_CHECK_LAUNCH();
}

void vision_pos_embed_backward_cuda(const float* d_out, const float* weight, const int32_t* row_offsets,
                                    const int32_t* entries, float* d_table, int64_t num_patches, int64_t table_rows,
                                    int64_t hidden, cudaStream_t stream) {
  CHECK(num_patches >= 0 && table_rows > 0 && hidden > 0, "vision_pos_embed_backward_cuda: bad size patches ",
        num_patches, ", table rows ", table_rows, ", hidden ", hidden);
  if (num_patches == 0) return;
  const dim3 grid(static_cast<unsigned>(table_rows), static_cast<unsigned>((hidden + kThreads - 1) / kThreads));
  pos_embed_backward_kernel<<<grid, kThreads, 0, stream>>>(d_out, weight, row_offsets, entries, d_table, hidden);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
