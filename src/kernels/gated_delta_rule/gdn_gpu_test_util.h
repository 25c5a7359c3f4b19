// Small helpers shared by the Gated DeltaNet GPU tests: bf16 rounding of reference inputs,
// device upload of int32 offsets, poisoned outputs, checked comparisons and CUDA-event timing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "kernels/common/tensor_compare.h"
#include "kernels/gemm/gpu_timing.h"

namespace deltamoe::gdn_gpu_test {

// The f32 values a bf16 upload of `values` will hold (the reference runs on exactly these).
inline HostTensor bf16_rounded(const HostTensor& values) {
  return values.to_dtype(DType::bf16).to_f32();
}

inline __nv_bfloat16* bf16_ptr(const DeviceTensor& t) {
  return static_cast<__nv_bfloat16*>(t.view.data);
}
inline float* f32_ptr(const DeviceTensor& t) { return static_cast<float*>(t.view.data); }

// cu_seqlens [N+1] from sequence lengths.
inline std::vector<int32_t> offsets_of(const std::vector<int>& lengths) {
  std::vector<int32_t> offsets{0};
  for (int len : lengths) offsets.push_back(offsets.back() + len);
  return offsets;
}

inline DeviceTensor upload_offsets(const std::vector<int32_t>& offsets) {
  HostTensor host(DType::i32, Shape{static_cast<int64_t>(offsets.size())});
  std::copy(offsets.begin(), offsets.end(), host.as<int32_t>());
  return to_device(host);
}

// A device tensor filled with 0xFF bytes (NaN as bf16 or f32): unwritten outputs cannot pass.
inline DeviceTensor poisoned(DType dtype, Shape shape) {
  DeviceTensor t = device_tensor(dtype, shape);
  device_fill_bytes(t.view, 0xFF);
  return t;
}

inline HostTensor download_f32(const DeviceTensor& t) { return to_host(t.view).to_f32(); }

// Prints the comparison and fails the test on a non-finite value or rel_l2 above `tolerance`.
inline void expect_close(const std::string& name, const HostTensor& got, const HostTensor& ref,
                         double tolerance) {
  const CompareResult r = compare_tensors(name, got, ref);
  EXPECT_TRUE(r.all_finite) << name << " has non-finite values";
  EXPECT_LE(r.rel_l2, tolerance) << name << " rel_l2 above " << tolerance;
}

// Median milliseconds of `repeats` runs of `body` on the default stream after `warmup` runs
// (gpu_timing.h's median_ms, for bodies that launch on the default stream themselves).
inline double median_ms(const std::function<void()>& body, int warmup = 3, int repeats = 20) {
  return deltamoe::median_ms([&](cudaStream_t) { body(); }, nullptr, warmup, repeats);
}

// H200 peaks the timing lines compare against (HBM3e bandwidth, dense bf16 tensor cores).
constexpr double kH200BandwidthGBs = 4800.0;
constexpr double kH200Bf16Tflops = 989.0;

inline void print_bandwidth(const char* what, double ms, double bytes) {
  const double gbs = bytes / (ms * 1e-3) / 1e9;
  std::printf("  TIMING %-36s %8.3f ms  %8.1f GB/s  (floor %.3f ms at %.0f GB/s)\n", what, ms, gbs,
              bytes / (kH200BandwidthGBs * 1e9) * 1e3, kH200BandwidthGBs);
}

}  // namespace deltamoe::gdn_gpu_test
