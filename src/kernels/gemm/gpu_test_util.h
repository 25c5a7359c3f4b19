// Helpers for the GPU tests of the products (dense, grouped, experts, router): random inputs already rounded to bf16 (so the fp32 reference
// sees exactly what the GPU sees), typed device pointers, and a tolerance check that prints.
#pragma once

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "kernels/common/tensor_compare.h"

namespace deltamoe {

inline HostTensor random_bf16_exact(Shape shape, uint64_t seed, float scale = 1.0f) {
  return random_normal_tensor(shape, seed, scale).to_dtype(DType::bf16).to_f32();
}

// Timing data: a pool of 4,099 random values repeated (sampling 10^9 normals on the host is slow;
// the speed of the products does not depend on the values).
inline HostTensor pattern_tensor(Shape shape, uint64_t seed, float scale) {
  const int64_t pool_size = 4099;
  HostTensor pool = random_normal_tensor({pool_size}, seed, scale), out(DType::f32, shape);
  for (int64_t i = 0; i < out.numel(); ++i) out.as<float>()[i] = pool.as<float>()[i % pool_size];
  return out;
}

inline __nv_bfloat16* bf16_ptr(const DeviceTensor& t) { return static_cast<__nv_bfloat16*>(t.view.data); }
inline float* f32_ptr(const DeviceTensor& t) { return static_cast<float*>(t.view.data); }

// Downloads `got`, compares with `ref`, prints the line, and expects finite values within rel_l2.
inline void expect_close(const std::string& name, const DeviceTensor& got, const HostTensor& ref, double max_rel_l2) {
  CompareResult result = compare_tensors(name, to_host(got.view), ref);
  EXPECT_TRUE(result.all_finite) << name << " has non-finite values";
  EXPECT_LE(result.rel_l2, max_rel_l2) << name;
}

// A device tensor poisoned with 0xFF bytes (NaN for floats) so that unwritten outputs fail.
inline DeviceTensor poisoned_device_tensor(DType dtype, Shape shape) {
  DeviceTensor t = device_tensor(dtype, shape);
  device_fill_bytes(t.view, 0xFF);
  return t;
}

// A large bf16 device tensor for timing: one block of 2^20 random values (never zeros) repeated,
// so that gigabyte-sized inputs do not take minutes of host-side sampling.
inline DeviceTensor tiled_random_device_tensor(Shape shape, uint64_t seed, float scale) {
  constexpr int64_t kBlock = int64_t{1} << 20;
  HostTensor block = random_normal_tensor({kBlock}, seed, scale).to_dtype(DType::bf16);
  DeviceTensor out = device_tensor(DType::bf16, shape);
  auto* dst = static_cast<uint8_t*>(out.view.data);
  for (int64_t offset = 0; offset < shape.numel(); offset += kBlock) {
    const int64_t count = std::min(kBlock, shape.numel() - offset);
    CUDA_CHECK(cudaMemcpy(dst + offset * 2, block.data(), static_cast<size_t>(count) * 2, cudaMemcpyHostToDevice));
  }
  return out;
}

}  // namespace deltamoe
