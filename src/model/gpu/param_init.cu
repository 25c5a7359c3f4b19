// Random fill (counter-based hash + Box-Muller) and bf16 conversion of flat parameter buffers.
#include "model/gpu/param_init.h"

#include "core/cuda_check.h"
#include "core/error.h"

namespace deltamoe {

namespace {

// SplitMix64 finaliser: a good 64-bit mix of a counter, enough for benchmark weights.
__device__ uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void fill_normal_kernel(float* master, int64_t count, float mean, float std, uint64_t key, int64_t first) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t bits = mix64(key ^ mix64(static_cast<uint64_t>(i + first)));
    // Two 24-bit uniforms in (0, 1] and [0, 1) -> one normal (the second Box-Muller value is dropped).
    const float u1 = (static_cast<float>(bits >> 40) + 1.0f) * (1.0f / 16777216.0f);
    const float u2 = static_cast<float>((bits >> 8) & 0xFFFFFFull) * (1.0f / 16777216.0f);
    const float normal = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    master[i] = mean + std * normal;
  }
}

// Uniform in [0, 1) from the same counter hash (A_log's log(U(0.01, 16))).
__global__ void fill_log_uniform_kernel(float* out, int64_t count, float low, float high, uint64_t key,
                                        int64_t first) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t bits = mix64(key ^ mix64(static_cast<uint64_t>(i + first)));
    const float u = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);
    out[i] = logf(low + (high - low) * u);
  }
}

__global__ void fill_constant_kernel(float* out, int64_t count, float value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = value;
}

__global__ void convert_kernel(const float* in, __nv_bfloat16* out, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

int grid_for(int64_t count, int threads) {
  const int64_t blocks = (count + threads - 1) / threads;
  return static_cast<int>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

}  // namespace

void fill_normal_cuda(float* master, int64_t count, float mean, float std, uint64_t seed, uint64_t stream_id,
                      cudaStream_t stream, int64_t first) {
  CHECK(count >= 0, "fill_normal_cuda: negative count ", count);
  if (count == 0) return;
  const uint64_t key = seed * 0x100000001B3ull ^ (stream_id + 1) * 0x9E3779B97F4A7C15ull;
  fill_normal_kernel<<<grid_for(count, 256), 256, 0, stream>>>(master, count, mean, std, key, first);
  CUDA_CHECK_LAUNCH();
}

void init_param_cuda(InitKind init, float std, float* out, int64_t count, uint64_t seed, uint64_t stream_id,
                     cudaStream_t stream, int64_t first) {
  CHECK(count >= 0, "init_param_cuda: negative count ", count);
  if (count == 0) return;
  switch (init) {
    case InitKind::normal: fill_normal_cuda(out, count, 0.0f, std, seed, stream_id, stream, first); return;
    case InitKind::zeros:
    case InitKind::ones:
      fill_constant_kernel<<<grid_for(count, 256), 256, 0, stream>>>(out, count, init == InitKind::ones ? 1.0f : 0.0f);
      break;
    case InitKind::a_log: {
      const uint64_t key = seed * 0x100000001B3ull ^ (stream_id + 1) * 0x9E3779B97F4A7C15ull;
      fill_log_uniform_kernel<<<grid_for(count, 256), 256, 0, stream>>>(out, count, 0.01f, 16.0f, key, first);
      break;
    }
  }
  CUDA_CHECK_LAUNCH();
}

void convert_f32_to_bf16_cuda(const float* in, __nv_bfloat16* out, int64_t count, cudaStream_t stream) {
  CHECK(count >= 0, "convert_f32_to_bf16_cuda: negative count ", count);
  if (count == 0) return;
  convert_kernel<<<grid_for(count, 256), 256, 0, stream>>>(in, out, count);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
