// Device helpers shared by the dense kernels: load/store N consecutive bf16 (or fp32) values as
// fp32 (N = 8 is one 16-byte bf16 access, N = 4 one 8-byte access, N = 1 the scalar fallback for
// odd widths; the caller checks alignment), and warp sums.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace deltamoe {

template <int N>
__device__ __forceinline__ void load_bf16_as_f32(const __nv_bfloat16* src, float (&out)[N]) {
  if constexpr (N == 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(pairs[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  } else if constexpr (N == 4) {
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
    const float2 a = __bfloat1622float2(pairs[0]), b = __bfloat1622float2(pairs[1]);
    out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = __bfloat162float(src[i]);
  }
}

template <int N>
__device__ __forceinline__ void store_f32_as_bf16(__nv_bfloat16* dst, const float (&in)[N]) {
  if constexpr (N == 8) {
    uint4 raw;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    *reinterpret_cast<uint4*>(dst) = raw;
  } else if constexpr (N == 4) {
    uint2 raw;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
    pairs[0] = __floats2bfloat162_rn(in[0], in[1]);
    pairs[1] = __floats2bfloat162_rn(in[2], in[3]);
    *reinterpret_cast<uint2*>(dst) = raw;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = __float2bfloat16_rn(in[i]);
  }
}

// Type-generic forms for kernels whose operands may be bf16 or fp32 (the fp32 residual stream):
// N consecutive values as fp32, N = 8 as 16-byte accesses (two for fp32) when the caller checked
// alignment with can_use_vec8, N = 1 scalar.
template <int N>
__device__ __forceinline__ void load_as_f32(const __nv_bfloat16* src, float (&out)[N]) {
  load_bf16_as_f32<N>(src, out);
}

template <int N>
__device__ __forceinline__ void load_as_f32(const float* src, float (&out)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 v = reinterpret_cast<const float4*>(src)[i];
      out[4 * i] = v.x;
      out[4 * i + 1] = v.y;
      out[4 * i + 2] = v.z;
      out[4 * i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = src[i];
  }
}

template <int N>
__device__ __forceinline__ void store_from_f32(__nv_bfloat16* dst, const float (&in)[N]) {
  store_f32_as_bf16<N>(dst, in);
}

template <int N>
__device__ __forceinline__ void store_from_f32(float* dst, const float (&in)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i)
      reinterpret_cast<float4*>(dst)[i] = make_float4(in[4 * i], in[4 * i + 1], in[4 * i + 2], in[4 * i + 3]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = in[i];
  }
}

__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(float v) { return v; }

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// True when every pointer is 16-byte aligned and width is a multiple of 8 (rows stay aligned).
__host__ __forceinline__ bool can_use_vec8(int64_t width, const void* a, const void* b = nullptr,
                                           const void* c = nullptr, const void* d = nullptr) {
  auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  return width % 8 == 0 && aligned(a) && aligned(b) && aligned(c) && aligned(d);
}

}  // namespace deltamoe
