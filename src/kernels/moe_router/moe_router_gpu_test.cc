// GPU test of the router against the CPU reference: projection (cuBLAS), softmax / top-k /
// renormalisation (choice checked for validity, values with the choice pinned), backward and
// projection backward, the hi/lo split projection against an fp32 product; E up to 512, odd E,
// T=1; timing at 8192 tokens x 256 experts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/dtype.h"
#include "kernels/common/tensor_compare.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/linear/linear.h"
#include "kernels/moe_router/moe_router.h"
#include "kernels/moe_router/moe_router_cuda.h"

namespace deltamoe {
namespace {

HostTensor plus(const HostTensor& a, const HostTensor& b) {
  HostTensor out(DType::f32, a.shape());
  for (int64_t i = 0; i < a.numel(); ++i) out.as<float>()[i] = a.as<float>()[i] + b.as<float>()[i];
  return out;
}

struct RouterCase {
  int64_t tokens, experts, top_k;
};

void check_router(const RouterCase& c, uint64_t seed) {
  const int64_t T = c.tokens, E = c.experts, K = c.top_k;
  std::printf("router T=%lld E=%lld K=%lld\n", static_cast<long long>(T), static_cast<long long>(E),
              static_cast<long long>(K));
  HostTensor logits = random_normal_tensor({T, E}, seed, 2.0f);
  DeviceTensor logits_d = to_device(logits, DType::f32);
  DeviceTensor probs_d = device_tensor(DType::f32, {T, E}), idx_d = device_tensor(DType::i32, {T, K});
  DeviceTensor w_d = device_tensor(DType::f32, {T, K});
  for (DeviceTensor* t : {&probs_d, &idx_d, &w_d}) device_fill_bytes(t->view, 0xFF);
  moe_router_forward_cuda(f32_ptr(logits_d), f32_ptr(probs_d), static_cast<int32_t*>(idx_d.view.data), f32_ptr(w_d), T,
                          E, K, nullptr);
  HostTensor idx = to_host(idx_d.view);

  // The choice must be valid under the reference probabilities: distinct, in range, and no
  // unselected expert clearly above a selected one (1e-6 leaves room for near-ties only).
  HostTensor probs_ref(DType::f32, {T, E}), w_ref(DType::f32, {T, K});
  HostTensor idx_free(DType::i32, {T, K}), probs_free(DType::f32, {T, E}), w_free(DType::f32, {T, K});
  moe_router_forward_ref(logits.as<float>(), probs_free.as<float>(), idx_free.as<int32_t>(), w_free.as<float>(), T, E,
                         K);
  int64_t invalid = 0, differs_from_free_choice = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<bool> chosen(E, false);
    float min_selected = 2.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = idx.as<int32_t>()[t * K + k];
      if (e < 0 || e >= E || chosen[e]) {
        ++invalid;
        continue;
      }
      chosen[e] = true;
      min_selected = std::min(min_selected, probs_free.as<float>()[t * E + e]);
      differs_from_free_choice += e != idx_free.as<int32_t>()[t * K + k];
    }
    for (int64_t e = 0; e < E; ++e)
      if (!chosen[e] && probs_free.as<float>()[t * E + e] > min_selected + 1e-6f) ++invalid;
  }
  std::printf("  choice: %lld invalid, %lld slots differ from the reference's own choice (near-ties)\n",
              static_cast<long long>(invalid), static_cast<long long>(differs_from_free_choice));
  EXPECT_EQ(invalid, 0);
  EXPECT_LE(differs_from_free_choice, T * K / 100);
  if (invalid != 0) return;  // the pinned reference below would reject the indices

  moe_router_forward_given_choice_ref(logits.as<float>(), probs_ref.as<float>(), idx.as<int32_t>(), w_ref.as<float>(),
                                      T, E, K);
  // fp32 on both sides (expf vs std::exp, summation order): rel_l2 <= 1e-5.
  CompareResult p = compare_tensors("probs", to_host(probs_d.view), probs_ref);
  CompareResult w = compare_tensors("topk_weight", to_host(w_d.view), w_ref);

  HostTensor d_w = random_normal_tensor({T, K}, seed + 1);
  HostTensor d_init = random_normal_tensor({T, E}, seed + 2, 0.1f);
  HostTensor d_logits_ref(DType::f32, {T, E});
  moe_router_backward_ref(probs_ref.as<float>(), idx.as<int32_t>(), w_ref.as<float>(), d_w.as<float>(),
                          d_logits_ref.as<float>(), T, E, K);
  DeviceTensor d_w_d = to_device(d_w, DType::f32);
  DeviceTensor d_logits_d = device_tensor(DType::f32, {T, E}), d_acc_d = to_device(d_init, DType::f32);
  DeviceTensor d_bf16_d = device_tensor(DType::bf16, {T, E});
  device_fill_bytes(d_logits_d.view, 0xFF);
  device_fill_bytes(d_bf16_d.view, 0xFF);
  moe_router_backward_cuda(f32_ptr(probs_d), static_cast<const int32_t*>(idx_d.view.data), f32_ptr(w_d), f32_ptr(d_w_d),
                           f32_ptr(d_logits_d), nullptr, false, T, E, K, nullptr);
  moe_router_backward_cuda(f32_ptr(probs_d), static_cast<const int32_t*>(idx_d.view.data), f32_ptr(w_d), f32_ptr(d_w_d),
                           f32_ptr(d_acc_d), static_cast<__nv_bfloat16*>(d_bf16_d.view.data), true, T, E, K, nullptr);
  const HostTensor d_acc_ref = plus(d_init, d_logits_ref);
  CompareResult d = compare_tensors("d_logits (written)", to_host(d_logits_d.view), d_logits_ref);
  CompareResult da = compare_tensors("d_logits (added to)", to_host(d_acc_d.view), d_acc_ref);
  CompareResult db = compare_tensors("d_logits bf16 copy", to_host(d_bf16_d.view), d_acc_ref);
  for (const CompareResult& r : {p, w, d, da}) {
    EXPECT_TRUE(r.all_finite);
    EXPECT_LE(r.rel_l2, 1e-5);
  }
  EXPECT_TRUE(db.all_finite);
  EXPECT_LE(db.rel_l2, 1e-2);  // one bf16 rounding
}

TEST(MoeRouterGpu, MatchesReference) {
  const RouterCase cases[] = {
      {1, 4, 1},       // T = 1, K = 1
      {1, 8, 8},       // K = E
      {33, 37, 5},     // odd E (lanes with fewer experts)
      {257, 256, 8},   // Qwen3.5-35B-A3B
      {100, 512, 10},  // Qwen3.5-397B-A17B
  };
  uint64_t seed = 300;
  for (const RouterCase& c : cases) check_router(c, seed += 10);
}

TEST(MoeRouterGpu, TiesGoToTheLowerExpert) {
  // All logits equal: the reference picks experts 0..K-1; so must the device.
  const int64_t T = 3, E = 64, K = 6;
  HostTensor logits = HostTensor::from_f32(std::vector<float>(T * E, 0.25f), {T, E});
  DeviceTensor logits_d = to_device(logits, DType::f32);
  DeviceTensor probs_d = device_tensor(DType::f32, {T, E}), idx_d = device_tensor(DType::i32, {T, K});
  DeviceTensor w_d = device_tensor(DType::f32, {T, K});
  moe_router_forward_cuda(f32_ptr(logits_d), f32_ptr(probs_d), static_cast<int32_t*>(idx_d.view.data), f32_ptr(w_d), T,
                          E, K, nullptr);
  HostTensor idx = to_host(idx_d.view);
  int64_t wrong = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) wrong += idx.as<int32_t>()[t * K + k] != k;
  std::printf("  tie order: %lld slots not in 0..K-1 order\n", static_cast<long long>(wrong));
  EXPECT_EQ(wrong, 0);
}

TEST(MoeRouterGpu, ProjectionMatchesLinearReference) {
  GemmContext gemm;
  const std::tuple<int64_t, int64_t, int64_t> shapes[] = {{1, 64, 8}, {45, 131, 37}, {300, 2048, 256}};
  for (const auto& [T, C, E] : shapes) {
    std::printf("router projection T=%lld C=%lld E=%lld\n", static_cast<long long>(T), static_cast<long long>(C),
                static_cast<long long>(E));
    HostTensor x = random_bf16_exact({T, C}, 1), w = random_bf16_exact({E, C}, 2, 0.05f);
    HostTensor d_logits = random_bf16_exact({T, E}, 3);
    HostTensor d_w_init = random_normal_tensor({E, C}, 4);
    HostTensor logits_ref(DType::f32, {T, E}), dx_ref(DType::f32, {T, C}), d_w_ref(DType::f32, {E, C});
    std::fill(d_w_ref.as<float>(), d_w_ref.as<float>() + E * C, 0.0f);
    linear_forward_ref(x.as<float>(), w.as<float>(), logits_ref.as<float>(), T, C, E);
    linear_backward_ref(x.as<float>(), w.as<float>(), d_logits.as<float>(), dx_ref.as<float>(), d_w_ref.as<float>(), T,
                        C, E);
    DeviceTensor x_d = to_device(x, DType::bf16), w_d = to_device(w, DType::bf16);
    DeviceTensor dl_d = to_device(d_logits, DType::bf16), d_w_d = to_device(d_w_init, DType::f32);
    DeviceTensor logits_d = device_tensor(DType::f32, {T, E}), dx_d = device_tensor(DType::bf16, {T, C});
    device_fill_bytes(logits_d.view, 0xFF);
    device_fill_bytes(dx_d.view, 0xFF);
    moe_router_logits_cuda(gemm, bf16_ptr(x_d), bf16_ptr(w_d), f32_ptr(logits_d), T, C, E, nullptr);
    moe_router_logits_backward_cuda(gemm, bf16_ptr(x_d), bf16_ptr(w_d), bf16_ptr(dl_d),
                                    static_cast<__nv_bfloat16*>(dx_d.view.data), false, f32_ptr(d_w_d), T, C, E,
                                    nullptr);
    HostTensor d_w_got = to_host(d_w_d.view);
    for (int64_t i = 0; i < E * C; ++i) d_w_got.as<float>()[i] -= d_w_init.as<float>()[i];
    CompareResult l = compare_tensors("logits (f32)", to_host(logits_d.view), logits_ref);
    CompareResult dx = compare_tensors("dx (bf16)", to_host(dx_d.view), dx_ref);
    CompareResult dw = compare_tensors("d_w increment (f32)", d_w_got, d_w_ref);
    EXPECT_TRUE(l.all_finite && dx.all_finite && dw.all_finite);
    EXPECT_LE(l.rel_l2, 1e-4);   // fp32 output, summation order only
    EXPECT_LE(dx.rel_l2, 1e-2);  // one bf16 rounding
    EXPECT_LE(dw.rel_l2, 1e-4);
  }
}

// hi = bf16(v), lo = bf16(v - hi), on the host.
void split_hi_lo(const HostTensor& v, HostTensor* hi, HostTensor* lo) {
  *hi = HostTensor(DType::f32, v.shape());
  *lo = HostTensor(DType::f32, v.shape());
  for (int64_t i = 0; i < v.numel(); ++i) {
    hi->as<float>()[i] = round_to_bf16(v.as<float>()[i]);
    lo->as<float>()[i] = round_to_bf16(v.as<float>()[i] - hi->as<float>()[i]);
  }
}

TEST(MoeRouterGpu, SplitProjectionMatchesFp32Product) {
  GemmContext gemm;
  const std::tuple<int64_t, int64_t, int64_t> shapes[] = {{1, 64, 8}, {45, 131, 37}, {300, 2048, 256}};
  for (const auto& [T, C, E] : shapes) {
    // fp32 operands that bf16 cannot hold: the plain bf16 product is off by ~2e-3, the split one
    // only by fp32 summation order.
    const HostTensor x = random_normal_tensor({T, C}, 11), w = random_normal_tensor({E, C}, 12, 0.05f);
    HostTensor x_hi, x_lo, w_hi, w_lo;
    split_hi_lo(x, &x_hi, &x_lo);
    split_hi_lo(w, &w_hi, &w_lo);
    HostTensor logits_ref(DType::f32, {T, E});
    linear_forward_ref(x.as<float>(), w.as<float>(), logits_ref.as<float>(), T, C, E);
    DeviceTensor x_hi_d = to_device(x_hi, DType::bf16), x_lo_d = to_device(x_lo, DType::bf16);
    DeviceTensor w_hi_d = to_device(w_hi, DType::bf16), w_lo_d = to_device(w_lo, DType::bf16);
    DeviceTensor split_d = device_tensor(DType::f32, {T, E}), plain_d = device_tensor(DType::f32, {T, E});
    device_fill_bytes(split_d.view, 0xFF);
    moe_router_logits_split_cuda(gemm, bf16_ptr(x_hi_d), bf16_ptr(x_lo_d), bf16_ptr(w_hi_d), bf16_ptr(w_lo_d),
                                 f32_ptr(split_d), T, C, E, nullptr);
    moe_router_logits_cuda(gemm, bf16_ptr(x_hi_d), bf16_ptr(w_hi_d), f32_ptr(plain_d), T, C, E, nullptr);
    std::printf("router split projection T=%lld C=%lld E=%lld\n", static_cast<long long>(T),
                static_cast<long long>(C), static_cast<long long>(E));
    CompareResult split = compare_tensors("logits, hi/lo operands", to_host(split_d.view), logits_ref);
    CompareResult plain = compare_tensors("logits, bf16 operands (for scale)", to_host(plain_d.view), logits_ref);
    EXPECT_TRUE(split.all_finite);
    EXPECT_LE(split.rel_l2, 2e-5);
    EXPECT_GE(plain.rel_l2, 10 * split.rel_l2);  // the split is what buys the precision
  }
}

TEST(MoeRouterGpu, BadSizesAreRefused) {
  EXPECT_THROW(moe_router_forward_cuda(nullptr, nullptr, nullptr, nullptr, 4, 1024, 8, nullptr), Error);  // E > 512
  EXPECT_THROW(moe_router_forward_cuda(nullptr, nullptr, nullptr, nullptr, 4, 8, 9, nullptr), Error);     // K > E
  EXPECT_THROW(
      moe_router_backward_cuda(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, false, 4, 64, 33, nullptr),
      Error);  // K > 32
}

TEST(MoeRouterGpu, Timing35B) {
  const int64_t T = 8192, C = 2048, E = 256, K = 8;
  GemmContext gemm;
  DeviceTensor x_d = to_device(random_normal_tensor({T, C}, 1), DType::bf16);
  DeviceTensor w_d = to_device(random_normal_tensor({E, C}, 2, 0.02f), DType::bf16);
  DeviceTensor logits_d = device_tensor(DType::f32, {T, E}), probs_d = device_tensor(DType::f32, {T, E});
  DeviceTensor idx_d = device_tensor(DType::i32, {T, K}), tw_d = device_tensor(DType::f32, {T, K});
  DeviceTensor dtw_d = to_device(random_normal_tensor({T, K}, 3), DType::f32);
  DeviceTensor dl_d = device_tensor(DType::f32, {T, E}), dl16_d = device_tensor(DType::bf16, {T, E});
  std::printf("router, T=8192 E=256 K=8 H=2048\n");
  print_flop_timing("logits x W^T (cuBLAS, f32 out)",
                    median_ms(
                        [&](cudaStream_t s) {
                          moe_router_logits_cuda(gemm, bf16_ptr(x_d), bf16_ptr(w_d), f32_ptr(logits_d), T, C, E,
                                                 s);
                        },
                        nullptr),
                    2.0 * T * C * E);
  const int32_t* idx = static_cast<const int32_t*>(idx_d.view.data);
  // Forward reads logits, writes probs (+ small top-k outputs); backward reads probs, writes d_logits and bf16.
  print_bandwidth_timing("softmax + top-k + renormalise",
                         median_ms(
                             [&](cudaStream_t s) {
                               moe_router_forward_cuda(f32_ptr(logits_d), f32_ptr(probs_d),
                                                       static_cast<int32_t*>(idx_d.view.data), f32_ptr(tw_d), T, E, K,
                                                       s);
                             },
                             nullptr),
                         2.0 * T * E * 4);
  print_bandwidth_timing("router backward (f32 + bf16 d_logits)",
                         median_ms(
                             [&](cudaStream_t s) {
                               moe_router_backward_cuda(f32_ptr(probs_d), idx, f32_ptr(tw_d), f32_ptr(dtw_d),
                                                        f32_ptr(dl_d), static_cast<__nv_bfloat16*>(dl16_d.view.data),
                                                        false, T, E, K, s);
                             },
                             nullptr),
                         T * E * (4.0 + 4.0 + 2.0));
  device_synchronize();
}

}  // namespace
}  // namespace deltamoe
