// GPU test of the GDN gate kernels against the fp32 CPU reference on the same fp32 a, b (the GPU
// keeps the gate pre-activations and their gradients in fp32): odd head counts, pre-activations on
// both sides of softplus's threshold, and the 35B shape timed.
#include <gtest/gtest.h>

#include <cstdio>

#include "kernels/gated_delta_rule/gdn_gpu_test_util.h"
#include "kernels/gdn_gates/gdn_gates.h"
#include "kernels/gdn_gates/gdn_gates_cuda.h"

namespace deltamoe {
namespace {

using namespace gdn_gpu_test;

// g, beta, da, db are fp32 outputs of fp32 math on identical inputs: only expf/log1pf ulps differ.
// (da, db were bf16 before, at 1e-2; 1e-5 also proves that no bf16 rounding is left in them.)
constexpr double kF32Tolerance = 1e-5;
// dA_log, ddt_bias: fp32 sums over all tokens in a different order (serial on the CPU, so the
// reference itself carries ~1e-5 relative rounding at 8192 tokens).
constexpr double kSumTolerance = 1e-3;

void run_case(int64_t tokens, int heads, float a_scale, bool time_it) {
  std::printf("case: T=%lld H=%d |a| scale %.0f\n", static_cast<long long>(tokens), heads, a_scale);
  // Unrounded fp32 gates: a bf16 round trip anywhere on the GPU path would show at ~1e-3.
  const HostTensor a = random_normal_tensor(Shape{tokens, heads}, 31, a_scale);
  const HostTensor b = random_normal_tensor(Shape{tokens, heads}, 32, 2.0f);
  const HostTensor A_log = random_normal_tensor(Shape{heads}, 33, 0.5f);
  const HostTensor dt_bias = random_normal_tensor(Shape{heads}, 34);
  const HostTensor dg = random_normal_tensor(Shape{tokens, heads}, 35);
  const HostTensor dbeta = random_normal_tensor(Shape{tokens, heads}, 36);

  HostTensor g_ref(DType::f32, Shape{tokens, heads}), beta_ref(DType::f32, Shape{tokens, heads});
  HostTensor da_ref(DType::f32, Shape{tokens, heads}), db_ref(DType::f32, Shape{tokens, heads});
  HostTensor dA_log_ref = random_normal_tensor(Shape{heads}, 37);  // "added to"
  HostTensor ddt_ref = random_normal_tensor(Shape{heads}, 38);
  gdn_gates_forward_ref(a.as<float>(), b.as<float>(), A_log.as<float>(), dt_bias.as<float>(),
                        tokens, heads, g_ref.as<float>(), beta_ref.as<float>());
  gdn_gates_backward_ref(a.as<float>(), b.as<float>(), A_log.as<float>(), dt_bias.as<float>(),
                         dg.as<float>(), dbeta.as<float>(), tokens, heads, da_ref.as<float>(),
                         db_ref.as<float>(), dA_log_ref.as<float>(), ddt_ref.as<float>());

  DeviceTensor d_a = to_device(a), d_b = to_device(b);
  DeviceTensor d_A = to_device(A_log), d_dt = to_device(dt_bias);
  DeviceTensor d_dg = to_device(dg), d_dbeta = to_device(dbeta);
  DeviceTensor d_g = poisoned(DType::f32, Shape{tokens, heads});
  DeviceTensor d_beta = poisoned(DType::f32, Shape{tokens, heads});
  DeviceTensor d_da = poisoned(DType::f32, Shape{tokens, heads});
  DeviceTensor d_db = poisoned(DType::f32, Shape{tokens, heads});
  DeviceTensor d_dA = to_device(random_normal_tensor(Shape{heads}, 37));
  DeviceTensor d_ddt = to_device(random_normal_tensor(Shape{heads}, 38));
  gdn_gates_forward_cuda(f32_ptr(d_a), f32_ptr(d_b), f32_ptr(d_A), f32_ptr(d_dt), tokens, heads,
                         f32_ptr(d_g), f32_ptr(d_beta), nullptr);
  gdn_gates_backward_cuda(f32_ptr(d_a), f32_ptr(d_b), f32_ptr(d_A), f32_ptr(d_dt),
                          f32_ptr(d_dg), f32_ptr(d_dbeta), tokens, heads, f32_ptr(d_da),
                          f32_ptr(d_db), f32_ptr(d_dA), f32_ptr(d_ddt), nullptr);
  device_synchronize();
  expect_close("g", download_f32(d_g), g_ref, kF32Tolerance);
  expect_close("beta", download_f32(d_beta), beta_ref, kF32Tolerance);
  expect_close("da", download_f32(d_da), da_ref, kF32Tolerance);
  expect_close("db", download_f32(d_db), db_ref, kF32Tolerance);
  expect_close("dA_log (added to)", download_f32(d_dA), dA_log_ref, kSumTolerance);
  expect_close("ddt_bias (added to)", download_f32(d_ddt), ddt_ref, kSumTolerance);
  // Deterministic: a rerun from the same start gives the same bits; frozen (null) parameters
  // leave da and db as they were.
  DeviceTensor d_dA_again = to_device(random_normal_tensor(Shape{heads}, 37));
  DeviceTensor d_ddt_again = to_device(random_normal_tensor(Shape{heads}, 38));
  DeviceTensor d_da_frozen = poisoned(DType::f32, Shape{tokens, heads});
  DeviceTensor d_db_frozen = poisoned(DType::f32, Shape{tokens, heads});
  gdn_gates_backward_cuda(f32_ptr(d_a), f32_ptr(d_b), f32_ptr(d_A), f32_ptr(d_dt), f32_ptr(d_dg), f32_ptr(d_dbeta),
                          tokens, heads, f32_ptr(d_da), f32_ptr(d_db), f32_ptr(d_dA_again), f32_ptr(d_ddt_again),
                          nullptr);
  gdn_gates_backward_cuda(f32_ptr(d_a), f32_ptr(d_b), f32_ptr(d_A), f32_ptr(d_dt), f32_ptr(d_dg), f32_ptr(d_dbeta),
                          tokens, heads, f32_ptr(d_da_frozen), f32_ptr(d_db_frozen), nullptr, nullptr, nullptr);
  device_synchronize();
  EXPECT_TRUE(device_bytes_equal(d_dA, d_dA_again) && device_bytes_equal(d_ddt, d_ddt_again))
      << "the parameter gradients are not deterministic";
  EXPECT_TRUE(device_bytes_equal(d_da, d_da_frozen) && device_bytes_equal(d_db, d_db_frozen));

  if (time_it) {
    const double fwd_ms = median_ms([&] {
      gdn_gates_forward_cuda(f32_ptr(d_a), f32_ptr(d_b), f32_ptr(d_A), f32_ptr(d_dt), tokens,
                             heads, f32_ptr(d_g), f32_ptr(d_beta), nullptr);
    });
    // Reads a, b; writes g, beta (all fp32).
    print_bandwidth("gdn_gates forward", fwd_ms, tokens * heads * (4.0 * 4));
    // The parameter gradients keep accumulating over the repeats: only the time is looked at here.
    const double bwd_ms = median_ms([&] {
      gdn_gates_backward_cuda(f32_ptr(d_a), f32_ptr(d_b), f32_ptr(d_A), f32_ptr(d_dt),
                              f32_ptr(d_dg), f32_ptr(d_dbeta), tokens, heads, f32_ptr(d_da),
                              f32_ptr(d_db), f32_ptr(d_dA), f32_ptr(d_ddt), nullptr);
    });
    // Reads a, b, dg, dbeta; writes da, db (all fp32).
    print_bandwidth("gdn_gates backward", bwd_ms, tokens * heads * (6.0 * 4));
  }
}

TEST(GdnGatesGpu, OddShapes) {
  run_case(1, 1, 1.0f, false);
  run_case(67, 5, 3.0f, false);
}

// Large |a| reaches softplus's linear branch (a + dt_bias > 20) and its far negative tail.
TEST(GdnGatesGpu, SoftplusThresholdBothSides) { run_case(300, 7, 15.0f, false); }

// Qwen3.5-35B-A3B: 32 value heads, 8192 tokens.
TEST(GdnGatesGpu, Qwen35BShapeTimed) { run_case(8192, 32, 1.0f, true); }

}  // namespace
}  // namespace deltamoe
