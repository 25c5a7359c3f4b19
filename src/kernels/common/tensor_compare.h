// Comparison of a computed tensor against its reference, as every kernel test reports it:
// max |diff|, max |ref|, ||diff|| / ||ref||, and whether any value is not finite.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace deltamoe {

struct CompareResult {
  double max_abs_diff = 0;
  double max_abs_ref = 0;
  double rel_l2 = 0;       // ||got - ref|| / ||ref|| (||got - ref|| when ref is all zero)
  bool all_finite = true;  // NaN or Inf in `got` never passes
  int64_t count = 0;
};

inline CompareResult compare_values(const float* got, const float* ref, int64_t count) {
  CompareResult result;
  result.count = count;
  double diff_sq = 0, ref_sq = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (!std::isfinite(got[i])) result.all_finite = false;
    double diff = static_cast<double>(got[i]) - ref[i];
    diff_sq += diff * diff;
    ref_sq += static_cast<double>(ref[i]) * ref[i];
    result.max_abs_diff = std::max(result.max_abs_diff, std::fabs(diff));
    result.max_abs_ref = std::max(result.max_abs_ref, std::fabs(static_cast<double>(ref[i])));
  }
  result.rel_l2 = ref_sq > 0 ? std::sqrt(diff_sq / ref_sq) : std::sqrt(diff_sq);
  return result;
}

// Compares two host tensors of any floating dtype (converted to f32) and prints one line.
inline CompareResult compare_tensors(const std::string& name, const HostTensor& got, const HostTensor& ref) {
  CHECK(got.shape() == ref.shape(), name, ": shape ", got.shape().str(), " vs reference ", ref.shape().str());
  HostTensor got32 = got.to_f32(), ref32 = ref.to_f32();
  CompareResult result = compare_values(got32.as<float>(), ref32.as<float>(), got.numel());
  std::printf("  %-40s n=%-9lld max|diff| %.3e  max|ref| %.3e  rel_l2 %.3e%s\n", name.c_str(),
              static_cast<long long>(result.count), result.max_abs_diff, result.max_abs_ref, result.rel_l2,
              result.all_finite ? "" : "  NOT FINITE");
  return result;
}

// Deterministic random host tensor, normal(0, scale) (never zeros: zeros hide unwritten outputs).
HostTensor random_normal_tensor(Shape shape, uint64_t seed, float scale = 1.0f);

}  // namespace deltamoe
