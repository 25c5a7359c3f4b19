// The deterministic fp64 sum of squares of fp32 (or bf16, widened) values divided by a divisor, as
// the optimizer's global gradient norm counts a gradient: sum over the values of
// fl32(fl64(g) / divisor)^2 in fp64 (grad_clip.h's sum_of_squares_f64 on the CPU, after
// divide_gradient). A fixed grid walks the values and its partial sums are added in block order, so
// a call gives the same bits every time.
// Sums formed elsewhere (a product's epilogue, kernels/grouped_gemm/grouped_gemm_cuda.h's
// WeightGradSquares) join as extra device doubles, added in their order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace deltamoe {

// A run of fp32 values in device memory (4-byte aligned).
struct DeviceF32Span {
  const float* data = nullptr;
  int64_t count = 0;
};

// Scratch of the reduction (the blocks' partial sums): at least this many bytes.
constexpr size_t kSumOfSquaresWorkspaceBytes = 1024 * sizeof(double);

// *out (device double) = sum over i < count of fl32(fl64(values[i]) / divisor)^2 in fp64. No host sync.
void sum_of_squares_cuda(const float* values, int64_t count, double divisor, double* out, void* workspace,
                         cudaStream_t stream);
// The same over bf16 values (2-byte aligned), each widened to fp32 (exactly) first: the gradients
// stored in bf16 (the routed experts').
void sum_of_squares_cuda(const __nv_bfloat16* values, int64_t count, double divisor, double* out, void* workspace,
                         cudaStream_t stream);

// *out = the same sum over every span of spans (a device array of num_spans, read on the device; a
// value counts once per span holding it) plus extra[0] + ... + extra[num_extra - 1] (device
// doubles, already squared and divided). num_spans 0 sums the extras alone. No host sync.
void sum_of_squares_cuda(const DeviceF32Span* spans, int num_spans, const double* extra, int64_t num_extra,
                         double divisor, double* out, void* workspace, cudaStream_t stream);

}  // namespace deltamoe
