// Timing of device work for the GPU tests' speed sections: CUDA events around each repeat after
// a warm-up, median of the repeats. Host code (g++), only for files built with CUDA.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "core/cuda_check.h"

namespace deltamoe {

// Median milliseconds of `repeats` runs of launch(stream) after `warmup` runs.
template <typename Launch>
double median_ms(Launch&& launch, cudaStream_t stream, int warmup = 3, int repeats = 10) {
  for (int i = 0; i < warmup; ++i) launch(stream);
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < repeats; ++i) {
    CUDA_CHECK(cudaEventRecord(start, stream));
    launch(stream);
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Ceilings on the H200: the measured dense bf16 matrix rate (lead's measurement) and an assumed
// device-copy bandwidth (HBM3e 4.8 TB/s datasheet, ~4 TB/s achievable; replace once measured).
constexpr double kDenseBf16TflopsCeiling = 790.0;
constexpr double kMemoryGBpsCeiling = 4000.0;

// One line: ms, achieved rate, and the floor at the measured ceiling.
inline void print_flop_timing(const char* name, double ms, double flops) {
  const double floor_ms = flops / (kDenseBf16TflopsCeiling * 1e12) * 1e3;
  std::printf("  TIMING %-44s %9.3f ms  %7.1f TFLOP/s  (floor %.3f ms at %.0f TFLOP/s, %.0f%% of ceiling)\n", name, ms,
              flops / (ms * 1e-3) / 1e12, floor_ms, kDenseBf16TflopsCeiling, 100.0 * floor_ms / ms);
}

inline void print_bandwidth_timing(const char* name, double ms, double bytes) {
  const double floor_ms = bytes / (kMemoryGBpsCeiling * 1e9) * 1e3;
  std::printf("  TIMING %-44s %9.3f ms  %7.1f GB/s  (floor %.3f ms at %.0f GB/s, %.0f%% of ceiling)\n", name, ms,
              bytes / (ms * 1e-3) / 1e9, floor_ms, kMemoryGBpsCeiling, 100.0 * floor_ms / ms);
}

}  // namespace deltamoe
