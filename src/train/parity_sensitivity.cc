// bf16 rounding of a checkpoint's weights and the per-tensor gradient distance used to measure how
// far one bf16 rounding moves a parity case's gradients (see docs/vision.md, "bf16 parity and conditioning").
#include "train/parity_sensitivity.h"

#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"

namespace deltamoe {

namespace {

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

ModelCheckpoint with_bf16_rounded_weights(const ModelCheckpoint& checkpoint) {
  ModelCheckpoint rounded = checkpoint;
  for (auto& [name, stored] : rounded.params) {
    if (ends_with(name, "A_log") || ends_with(name, "dt_bias")) continue;
    HostTensor values = stored.to_host().to_f32();
    float* data = values.as<float>();
    for (int64_t i = 0; i < values.numel(); ++i) data[i] = round_to_bf16(data[i]);
    stored = StoredTensor::from_host(values);
  }
  return rounded;
}

ModelCheckpoint with_perturbed_weights(const ModelCheckpoint& checkpoint, double relative, uint64_t seed) {
  ModelCheckpoint perturbed = checkpoint;
  Rng rng(seed);
  for (auto& [name, stored] : perturbed.params) {  // std::map: the same order, so the same draw, every time
    HostTensor values = stored.to_host().to_f32();
    float* data = values.as<float>();
    for (int64_t i = 0; i < values.numel(); ++i)
      data[i] = static_cast<float>(data[i] * (1.0 + (2.0 * rng.uniform_f64() - 1.0) * relative));
    stored = StoredTensor::from_host(values);
  }
  return perturbed;
}

double gradient_distance(const HostTensor& ours, const HostTensor& ref) {
  CHECK(ours.numel() == ref.numel(), "gradient_distance: ", ours.numel(), " elements against ", ref.numel());
  const HostTensor a = ours.to_f32(), b = ref.to_f32();
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.as<float>()[i], y = b.as<float>()[i];
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  if (std::isnan(diff)) return NAN;
  if (norm == 0) return diff == 0 ? 0.0 : INFINITY;
  return std::sqrt(diff / norm);
}

std::map<std::string, double> gradient_distances(const std::map<std::string, HostTensor>& ours,
                                                 const std::map<std::string, HostTensor>& ref) {
  std::map<std::string, double> distances;
  for (const auto& [name, tensor] : ref) {
    const auto found = ours.find(name);
    CHECK(found != ours.end(), "gradient_distances: no gradient for '", name, "'");
    CHECK(found->second.numel() == tensor.numel(), "gradient_distances: '", name, "' has ", found->second.numel(),
          " elements, the reference ", tensor.numel());
    distances[name] = gradient_distance(found->second, tensor);
  }
  return distances;
}

int64_t routing_differences(const std::vector<std::vector<int32_t>>& a, const std::vector<std::vector<int32_t>>& b,
                            int64_t top_k) {
  CHECK(top_k > 0, "routing_differences: top_k ", top_k);
  CHECK(a.size() == b.size(), "routing_differences: ", a.size(), " layers against ", b.size());
  int64_t count = 0;
  for (size_t layer = 0; layer < a.size(); ++layer) {
    CHECK(a[layer].size() == b[layer].size() && a[layer].size() % static_cast<size_t>(top_k) == 0,
          "routing_differences: layer ", layer, " has ", a[layer].size(), " entries against ", b[layer].size(),
          " (top_k ", top_k, ")");
    for (size_t start = 0; start < a[layer].size(); start += static_cast<size_t>(top_k)) {
      std::vector<int32_t> x(a[layer].begin() + start, a[layer].begin() + start + top_k);
      std::vector<int32_t> y(b[layer].begin() + start, b[layer].begin() + start + top_k);
      std::sort(x.begin(), x.end());
      std::sort(y.begin(), y.end());
      count += x != y;
    }
  }
  return count;
}

}  // namespace deltamoe
