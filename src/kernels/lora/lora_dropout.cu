// LoRA dropout on the GPU (lora_cuda.h): the adapter's input through the counter-based mask
// (lora_dropout_mask.h, the CPU reference's own function), and the masked add of the adapter's input
// gradient.
#include <algorithm>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/lora/lora_cuda.h"
#include "kernels/lora/lora_dropout_mask.h"

namespace deltamoe {

namespace {

unsigned grid_for(int64_t count) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((count + 255) / 256, int64_t{1} << 16)));
}

// Calls visit(at, factor) for every element of the [rows, cols] matrix: its index and its mask
// factor (keep_scale or 0). One thread per Philox block: four consecutive columns of one row.
template <typename Visit>
__device__ void for_each_masked(const LoraDropoutMask& mask, int64_t rows, int64_t cols, Visit visit) {
  const int64_t quads = (cols + 3) / 4, count = rows * quads;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / quads, quad = i % quads;
    const LoraPhilox4 block = lora_dropout_block(mask, row, quad);
    for (int j = 0; j < 4; ++j) {
      const int64_t col = quad * 4 + j;
      if (col >= cols) break;
      visit(row * cols + col, block.v[j] >= mask.threshold ? mask.keep_scale : 0.0f);
    }
  }
}

__global__ void dropout_apply_kernel(LoraDropoutMask mask, const __nv_bfloat16* x, __nv_bfloat16* out, int64_t rows,
                                     int64_t cols) {
  for_each_masked(mask, rows, cols, [&](int64_t at, float factor) {
    out[at] = __float2bfloat16(__bfloat162float(x[at]) * factor);
  });
}

template <typename Dst>
__global__ void dropout_add_kernel(LoraDropoutMask mask, const float* src, Dst* dst, int64_t rows, int64_t cols) {
  for_each_masked(mask, rows, cols, [&](int64_t at, float factor) {
    if constexpr (std::is_same_v<Dst, float>) {
      dst[at] += src[at] * factor;
    } else {
      dst[at] = __float2bfloat16(__bfloat162float(dst[at]) + src[at] * factor);
    }
  });
}

}  // namespace

void lora_dropout_apply_cuda(const LoraDropoutMask& mask, const __nv_bfloat16* x, __nv_bfloat16* out, int64_t rows,
                             int64_t cols, cudaStream_t stream) {
  if (rows * cols == 0) return;
  dropout_apply_kernel<<<grid_for(rows * ((cols + 3) / 4)), 256, 0, stream>>>(mask, x, out, rows, cols);
  CUDA_CHECK_LAUNCH();
}

void lora_dropout_add_cuda(const LoraDropoutMask& mask, const float* src, void* dst, DType dst_dtype, int64_t rows,
                           int64_t cols, cudaStream_t stream) {
  CHECK(dst_dtype == DType::f32 || dst_dtype == DType::bf16, "lora_dropout_add_cuda: dst must be f32 or bf16, got ",
        dtype_name(dst_dtype));
  if (rows * cols == 0) return;
  const unsigned grid = grid_for(rows * ((cols + 3) / 4));
  if (dst_dtype == DType::f32) {
    dropout_add_kernel<float><<<grid, 256, 0, stream>>>(mask, src, static_cast<float*>(dst), rows, cols);
  } else {
    dropout_add_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(mask, src, static_cast<__nv_bfloat16*>(dst), rows, cols);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
