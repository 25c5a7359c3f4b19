// GPU test of the load-balancing aux loss against the CPU reference: running sums over several
// layers, the value, each layer's d_logits (written and added to); timing at 8192 tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/device_buffer.h"
#include "kernels/common/tensor_compare.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/moe_aux_loss/moe_aux_loss.h"
#include "kernels/moe_aux_loss/moe_aux_loss_cuda.h"
#include "kernels/moe_router/moe_router.h"

namespace deltamoe {
namespace {

float* f32_ptr(DeviceTensor& t) { return static_cast<float*>(t.view.data); }

struct Layer {
  HostTensor probs, idx;
};

// One layer's router output from random logits (reference router: softmax, top-k).
Layer random_layer(int64_t rows, int64_t experts, int64_t top_k, uint64_t seed) {
  HostTensor logits = random_normal_tensor({rows, experts}, seed, 1.5f);
  Layer layer{HostTensor(DType::f32, {rows, experts}), HostTensor(DType::i32, {rows, top_k})};
  HostTensor weight(DType::f32, {rows, top_k});
  moe_router_forward_ref(logits.as<float>(), layer.probs.as<float>(), layer.idx.as<int32_t>(), weight.as<float>(), rows,
                         experts, top_k);
  return layer;
}

struct DeviceStats {
  DeviceTensor count, prob;
  MoeAuxDeviceStats view() { return {static_cast<double*>(count.view.data), static_cast<double*>(prob.view.data)}; }
};

DeviceStats device_stats(int64_t experts) {
  return {device_tensor(DType::f64, {experts}), device_tensor(DType::f64, {experts})};
}

double max_rel(const double* got, const std::vector<double>& ref) {
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    worst = std::max(worst, std::fabs(got[i] - ref[i]) / std::max(std::fabs(ref[i]), 1e-30));
  return worst;
}

void check_aux(int64_t rows, int64_t experts, int64_t top_k, int layers, uint64_t seed) {
  std::printf("aux loss R=%lld E=%lld K=%lld layers=%d\n", static_cast<long long>(rows),
              static_cast<long long>(experts), static_cast<long long>(top_k), layers);
  std::vector<Layer> host_layers;
  for (int l = 0; l < layers; ++l) host_layers.push_back(random_layer(rows, experts, top_k, seed + l));
  MoeAuxStats ref;
  DeviceStats stats = device_stats(experts);
  device_fill_bytes(stats.count.view, 0xFF);
  device_fill_bytes(stats.prob.view, 0xFF);
  moe_aux_stats_reset_cuda(stats.view(), experts, nullptr);
  DeviceBuffer workspace(moe_aux_loss_accumulate_workspace_bytes(rows, experts));
  std::vector<DeviceTensor> probs_d;
  for (const Layer& layer : host_layers) {
    moe_aux_loss_accumulate_ref(layer.probs.as<float>(), layer.idx.as<int32_t>(), rows, experts, top_k, &ref);
    probs_d.push_back(to_device(layer.probs, DType::f32));
    DeviceTensor idx_d = to_device(layer.idx);
    moe_aux_loss_accumulate_cuda(f32_ptr(probs_d.back()), static_cast<const int32_t*>(idx_d.view.data), rows, experts,
                                 top_k, stats.view(), workspace.data(), workspace.bytes(), nullptr);
    device_synchronize();  // idx_d is freed at the end of this iteration
  }
  const int64_t total_rows = rows * layers;
  DeviceTensor aux_d = device_tensor(DType::f64, {1});
  device_fill_bytes(aux_d.view, 0xFF);
  moe_aux_loss_value_cuda(stats.view(), experts, total_rows, static_cast<double*>(aux_d.view.data), nullptr);
  HostTensor count = to_host(stats.count.view), prob = to_host(stats.prob.view), aux = to_host(aux_d.view);
  const double aux_ref = moe_aux_loss_value(ref);
  const double count_err = max_rel(count.as<double>(), ref.selected_count);
  const double prob_err = max_rel(prob.as<double>(), ref.prob_sum);
  const double aux_err = std::fabs(aux.as<double>()[0] - aux_ref) / std::fabs(aux_ref);
  std::printf("  counts max rel err %.3e, prob sums max rel err %.3e, aux %.9f vs %.9f (rel %.3e)\n", count_err,
              prob_err, aux.as<double>()[0], aux_ref, aux_err);
  EXPECT_EQ(count_err, 0.0);  // integer counts are exact
  EXPECT_LE(prob_err, 1e-9);  // fp64 sums of the same fp32 values, another order
  EXPECT_LE(aux_err, 1e-9);
  EXPECT_TRUE(std::isfinite(aux.as<double>()[0]));

  // Backward of each layer for a loss d_aux * aux.
  const float d_aux = 0.37f;
  for (int l = 0; l < layers; ++l) {
    HostTensor d_ref(DType::f32, {rows, experts});
    moe_aux_loss_backward_ref(host_layers[l].probs.as<float>(), ref, d_aux, d_ref.as<float>(), rows);
    HostTensor d_init = random_normal_tensor({rows, experts}, seed + 100 + l, 1e-6f);
    DeviceTensor d_written = device_tensor(DType::f32, {rows, experts}), d_added = to_device(d_init, DType::f32);
    device_fill_bytes(d_written.view, 0xFF);
    moe_aux_loss_backward_cuda(f32_ptr(probs_d[l]), stats.view(), total_rows, d_aux, f32_ptr(d_written), false, rows,
                               experts, nullptr);
    moe_aux_loss_backward_cuda(f32_ptr(probs_d[l]), stats.view(), total_rows, d_aux, f32_ptr(d_added), true, rows,
                               experts, nullptr);
    HostTensor added_ref(DType::f32, {rows, experts});
    for (int64_t i = 0; i < rows * experts; ++i)
      added_ref.as<float>()[i] = d_init.as<float>()[i] + d_ref.as<float>()[i];
    // fp32 on both sides, coefficients from the same fp64 sums: rel_l2 <= 1e-5.
    CompareResult w = compare_tensors("d_logits (written)", to_host(d_written.view), d_ref);
    CompareResult a = compare_tensors("d_logits (added to)", to_host(d_added.view), added_ref);
    EXPECT_TRUE(w.all_finite && a.all_finite);
    EXPECT_LE(w.rel_l2, 1e-5);
    EXPECT_LE(a.rel_l2, 1e-5);
  }
}

TEST(MoeAuxLossGpu, MatchesReference) {
  check_aux(1, 4, 2, 1, 10);       // one row
  check_aux(37, 13, 3, 2, 20);     // odd sizes, partial chunk
  check_aux(300, 256, 8, 3, 30);   // Qwen3.5-35B-A3B router width over several chunks
  check_aux(129, 512, 10, 2, 40);  // Qwen3.5-397B-A17B width
}

TEST(MoeAuxLossGpu, BadSizesAreRefused) {
  EXPECT_THROW(moe_aux_loss_accumulate_cuda(nullptr, nullptr, 8, 16, 4, {}, nullptr, 0, nullptr), Error);  // ws
  EXPECT_THROW(moe_aux_loss_backward_cuda(nullptr, {}, 4, 1.0f, nullptr, false, 8, 16, nullptr), Error);   // rows
  EXPECT_THROW(moe_aux_stats_reset_cuda({}, 0, nullptr), Error);
}

TEST(MoeAuxLossGpu, Timing35B) {
  const int64_t rows = 8192, experts = 256, top_k = 8;
  Layer layer = random_layer(rows, experts, top_k, 5);
  DeviceTensor probs_d = to_device(layer.probs, DType::f32), idx_d = to_device(layer.idx);
  DeviceStats stats = device_stats(experts);
  moe_aux_stats_reset_cuda(stats.view(), experts, nullptr);
  DeviceBuffer workspace(moe_aux_loss_accumulate_workspace_bytes(rows, experts));
  DeviceTensor d_logits = device_tensor(DType::f32, {rows, experts});
  std::printf("aux loss, R=8192 E=256 K=8\n");
  print_bandwidth_timing("accumulate (reads probs + idx)",
                         median_ms(
                             [&](cudaStream_t s) {
                               moe_aux_loss_accumulate_cuda(
                                   f32_ptr(probs_d), static_cast<const int32_t*>(idx_d.view.data), rows, experts, top_k,
                                   stats.view(), workspace.data(), workspace.bytes(), s);
                             },
                             nullptr),
                         rows * experts * 4.0 + rows * top_k * 4.0);
  print_bandwidth_timing("backward (reads probs, writes d_logits)",
                         median_ms(
                             [&](cudaStream_t s) {
                               moe_aux_loss_backward_cuda(f32_ptr(probs_d), stats.view(), rows * 13, 0.001f,
                                                          f32_ptr(d_logits), false, rows, experts, s);
                             },
                             nullptr),
                         rows * experts * 8.0);
  device_synchronize();
}

}  // namespace
}  // namespace deltamoe
