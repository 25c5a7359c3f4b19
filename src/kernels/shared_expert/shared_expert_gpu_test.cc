// GPU test of the sigmoid-gated shared expert against the CPU reference: forward (written and
// added to), backward (dx, weight gradients as increments) over T=1, odd sizes and the
// Qwen3.5-35B-A3B widths; timing at 8192 tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "kernels/common/tensor_compare.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/shared_expert/shared_expert.h"
#include "kernels/shared_expert/shared_expert_cuda.h"

namespace deltamoe {
namespace {

HostTensor combine(const HostTensor& a, const HostTensor& b, float sign) {
  HostTensor a32 = a.to_f32(), b32 = b.to_f32(), out(DType::f32, a.shape());
  for (int64_t i = 0; i < a.numel(); ++i) out.as<float>()[i] = a32.as<float>()[i] + sign * b32.as<float>()[i];
  return out;
}

void check_shared(GemmContext& gemm, int64_t T, int64_t C, int64_t I, uint64_t seed) {
  std::printf("shared expert T=%lld C=%lld I=%lld\n", static_cast<long long>(T), static_cast<long long>(C),
              static_cast<long long>(I));
  const float wc = 1.0f / std::sqrt(static_cast<float>(C)), wi = 1.0f / std::sqrt(static_cast<float>(I));
  HostTensor x = random_bf16_exact({T, C}, seed), gate = random_bf16_exact({I, C}, seed + 1, wc);
  HostTensor up = random_bf16_exact({I, C}, seed + 2, wc), down = random_bf16_exact({C, I}, seed + 3, wi);
  HostTensor eg = random_bf16_exact({1, C}, seed + 4, wc), dy = random_bf16_exact({T, C}, seed + 5);
  HostTensor y_init = random_bf16_exact({T, C}, seed + 6, 0.05f), dx_init = random_bf16_exact({T, C}, seed + 7, 0.05f);
  HostTensor dg_init = random_normal_tensor({I, C}, seed + 8), du_init = random_normal_tensor({I, C}, seed + 9);
  HostTensor dd_init = random_normal_tensor({C, I}, seed + 10), de_init = random_normal_tensor({1, C}, seed + 11);

  HostTensor y_ref(DType::f32, {T, C}), dx_ref(DType::f32, {T, C});
  HostTensor dg_ref = dg_init.to_f32(), du_ref = du_init.to_f32(), dd_ref = dd_init.to_f32(), de_ref = de_init.to_f32();
  shared_expert_forward_ref(x.as<float>(), gate.as<float>(), up.as<float>(), down.as<float>(), eg.as<float>(),
                            y_ref.as<float>(), T, C, I);
  shared_expert_backward_ref(x.as<float>(), gate.as<float>(), up.as<float>(), down.as<float>(), eg.as<float>(),
                             dy.as<float>(), dx_ref.as<float>(), dg_ref.as<float>(), du_ref.as<float>(),
                             dd_ref.as<float>(), de_ref.as<float>(), T, C, I);

  DeviceTensor x_d = to_device(x, DType::bf16), gate_d = to_device(gate, DType::bf16);
  DeviceTensor up_d = to_device(up, DType::bf16), down_d = to_device(down, DType::bf16);
  DeviceTensor eg_d = to_device(eg, DType::bf16), dy_d = to_device(dy, DType::bf16);
  DeviceTensor y_d = device_tensor(DType::bf16, {T, C}), y_acc_d = to_device(y_init, DType::bf16);
  DeviceTensor dx_d = device_tensor(DType::bf16, {T, C}), dx_acc_d = to_device(dx_init, DType::bf16);
  DeviceTensor dg_d = to_device(dg_init, DType::f32), du_d = to_device(du_init, DType::f32);
  DeviceTensor dd_d = to_device(dd_init, DType::f32), de_d = to_device(de_init, DType::f32);
  device_fill_bytes(y_d.view, 0xFF);
  device_fill_bytes(dx_d.view, 0xFF);
  DeviceBuffer fwd_ws(shared_expert_forward_workspace_bytes(T, C, I));
  DeviceBuffer bwd_ws(shared_expert_backward_workspace_bytes(T, C, I));
  device_fill_bytes(TensorView(bwd_ws.data(), DType::u8, {static_cast<int64_t>(bwd_ws.bytes())}, Device::cuda), 0xFF);
  shared_expert_forward_cuda(gemm, bf16_ptr(x_d), bf16_ptr(gate_d), bf16_ptr(up_d), bf16_ptr(down_d), bf16_ptr(eg_d),
                             bf16_ptr(y_d), false, T, C, I, fwd_ws.data(), fwd_ws.bytes(), nullptr);
  shared_expert_forward_cuda(gemm, bf16_ptr(x_d), bf16_ptr(gate_d), bf16_ptr(up_d), bf16_ptr(down_d), bf16_ptr(eg_d),
                             bf16_ptr(y_acc_d), true, T, C, I, fwd_ws.data(), fwd_ws.bytes(), nullptr);
  // First backward writes dx and adds the weight gradients; the second only checks dx "added to"
  // (weight gradients of that call go to scratch copies).
  shared_expert_backward_cuda(gemm, bf16_ptr(x_d), bf16_ptr(gate_d), bf16_ptr(up_d), bf16_ptr(down_d), bf16_ptr(eg_d),
                              bf16_ptr(dy_d), bf16_ptr(dx_d), false, f32_ptr(dg_d), f32_ptr(du_d), f32_ptr(dd_d),
                              f32_ptr(de_d), T, C, I, bwd_ws.data(), bwd_ws.bytes(), nullptr);
  DeviceTensor s1 = device_tensor(DType::f32, {I, C}), s2 = device_tensor(DType::f32, {I, C});
  DeviceTensor s3 = device_tensor(DType::f32, {C, I}), s4 = device_tensor(DType::f32, {1, C});
  shared_expert_backward_cuda(gemm, bf16_ptr(x_d), bf16_ptr(gate_d), bf16_ptr(up_d), bf16_ptr(down_d), bf16_ptr(eg_d),
                              bf16_ptr(dy_d), bf16_ptr(dx_acc_d), true, f32_ptr(s1), f32_ptr(s2), f32_ptr(s3),
                              f32_ptr(s4), T, C, I, bwd_ws.data(), bwd_ws.bytes(), nullptr);
  device_synchronize();

  // bf16 intermediates (gate, up, h, d_out, d_gate, d_up) carry one rounding each: rel_l2 <= 1e-2.
  // The "added to" outputs are checked as increments so the initial values do not hide errors.
  std::vector<CompareResult> results;
  results.push_back(compare_tensors("y (written)", to_host(y_d.view), y_ref));
  results.push_back(compare_tensors("y (added to) increment", combine(to_host(y_acc_d.view), y_init, -1), y_ref));
  results.push_back(compare_tensors("dx (written)", to_host(dx_d.view), dx_ref));
  results.push_back(compare_tensors("dx (added to) increment", combine(to_host(dx_acc_d.view), dx_init, -1), dx_ref));
  results.push_back(
      compare_tensors("d_gate_proj increment", combine(to_host(dg_d.view), dg_init, -1), combine(dg_ref, dg_init, -1)));
  results.push_back(
      compare_tensors("d_up_proj increment", combine(to_host(du_d.view), du_init, -1), combine(du_ref, du_init, -1)));
  results.push_back(
      compare_tensors("d_down_proj increment", combine(to_host(dd_d.view), dd_init, -1), combine(dd_ref, dd_init, -1)));
  results.push_back(compare_tensors("d_expert_gate increment", combine(to_host(de_d.view), de_init, -1),
                                    combine(de_ref, de_init, -1)));
  for (const CompareResult& r : results) {
    EXPECT_TRUE(r.all_finite);
    EXPECT_LE(r.rel_l2, 1e-2);
  }
}

TEST(SharedExpertGpu, MatchesReference) {
  GemmContext gemm;
  check_shared(gemm, 1, 64, 32, 10);       // T = 1
  check_shared(gemm, 37, 53, 19, 20);      // odd everything
  check_shared(gemm, 600, 96, 40, 30);     // more than two token chunks of the gate gradient
  check_shared(gemm, 128, 2048, 512, 40);  // Qwen3.5-35B-A3B widths
}

// The forward in two calls (products into a pending buffer, other work, then apply) gives the
// fused call's y bitwise, written and added to: the expert-parallel MoE block relies on it to stay
// bitwise equal to one rank.
void check_split_forward(GemmContext& gemm, int64_t T, int64_t C, int64_t I, uint64_t seed) {
  const float wc = 1.0f / std::sqrt(static_cast<float>(C)), wi = 1.0f / std::sqrt(static_cast<float>(I));
  DeviceTensor x_d = to_device(random_bf16_exact({T, C}, seed), DType::bf16);
  DeviceTensor gate_d = to_device(random_bf16_exact({I, C}, seed + 1, wc), DType::bf16);
  DeviceTensor up_d = to_device(random_bf16_exact({I, C}, seed + 2, wc), DType::bf16);
  DeviceTensor down_d = to_device(random_bf16_exact({C, I}, seed + 3, wi), DType::bf16);
  DeviceTensor eg_d = to_device(random_bf16_exact({1, C}, seed + 4, wc), DType::bf16);
  const HostTensor y_init = random_bf16_exact({T, C}, seed + 6, 0.5f);
  DeviceBuffer ws(shared_expert_forward_workspace_bytes(T, C, I));
  DeviceBuffer pending_memory(shared_expert_pending_bytes(T, C));
  const SharedExpertPending pending = shared_expert_pending_in(pending_memory.data(), pending_memory.bytes(), T, C);
  for (bool accumulate : {false, true}) {
    DeviceTensor fused = to_device(y_init, DType::bf16), split = to_device(y_init, DType::bf16);
    shared_expert_forward_cuda(gemm, bf16_ptr(x_d), bf16_ptr(gate_d), bf16_ptr(up_d), bf16_ptr(down_d),
                               bf16_ptr(eg_d), bf16_ptr(fused), accumulate, T, C, I, ws.data(), ws.bytes(), nullptr);
    shared_expert_forward_products_cuda(gemm, bf16_ptr(x_d), bf16_ptr(gate_d), bf16_ptr(up_d), bf16_ptr(down_d),
                                        bf16_ptr(eg_d), pending, T, C, I, ws.data(), ws.bytes(), nullptr);
    // Other work reusing the workspace in between must not matter.
    device_fill_bytes(TensorView(ws.data(), DType::u8, {static_cast<int64_t>(ws.bytes())}, Device::cuda), 0xFF);
    shared_expert_forward_apply_cuda(pending, bf16_ptr(split), accumulate, T, C, nullptr);
    device_synchronize();
    const HostTensor want = to_host(fused.view), got = to_host(split.view);
    ASSERT_EQ(want.numel(), got.numel());
    EXPECT_EQ(std::memcmp(want.data(), got.data(), static_cast<size_t>(want.numel()) * 2), 0)
        << "T=" << T << " C=" << C << " I=" << I << " accumulate=" << accumulate;
  }
}

TEST(SharedExpertGpu, SplitForwardIsTheFusedForwardBitwise) {
  GemmContext gemm;
  check_split_forward(gemm, 1, 64, 32, 50);
  check_split_forward(gemm, 37, 53, 19, 60);
  check_split_forward(gemm, 512, 2048, 512, 70);  // Qwen3.5-35B-A3B widths
  EXPECT_THROW(shared_expert_pending_in(nullptr, 0, 4, 8), Error);
}

TEST(SharedExpertGpu, BadSizesAreRefused) {
  GemmContext gemm;
  EXPECT_THROW(shared_expert_forward_cuda(gemm, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, false, 4,
                                          0, 8, nullptr, 0, nullptr),
               Error);
  EXPECT_THROW(shared_expert_forward_cuda(gemm, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, false, 4,
                                          8, 8, nullptr, 16, nullptr),
               Error);  // workspace too small
}

TEST(SharedExpertGpu, Timing35B) {
  const int64_t T = 8192, C = 2048, I = 512;
  GemmContext gemm;
  DeviceTensor x_d = to_device(random_normal_tensor({T, C}, 1), DType::bf16);
  DeviceTensor gate_d = to_device(random_normal_tensor({I, C}, 2, 0.02f), DType::bf16);
  DeviceTensor up_d = to_device(random_normal_tensor({I, C}, 3, 0.02f), DType::bf16);
  DeviceTensor down_d = to_device(random_normal_tensor({C, I}, 4, 0.04f), DType::bf16);
  DeviceTensor eg_d = to_device(random_normal_tensor({1, C}, 5, 0.02f), DType::bf16);
  DeviceTensor dy_d = to_device(random_normal_tensor({T, C}, 6), DType::bf16);
  DeviceTensor y_d = device_tensor(DType::bf16, {T, C}), dx_d = device_tensor(DType::bf16, {T, C});
  DeviceTensor dg_d = device_tensor(DType::f32, {I, C}), du_d = device_tensor(DType::f32, {I, C});
  DeviceTensor dd_d = device_tensor(DType::f32, {C, I}), de_d = device_tensor(DType::f32, {1, C});
  for (DeviceTensor* t : {&dg_d, &du_d, &dd_d, &de_d}) device_fill_bytes(t->view, 0);
  DeviceBuffer fwd_ws(shared_expert_forward_workspace_bytes(T, C, I));
  DeviceBuffer bwd_ws(shared_expert_backward_workspace_bytes(T, C, I));
  const double matmul = 2.0 * T * C * I;  // one of the three projections
  std::printf("shared expert, T=8192 H=2048 Is=512 (floor = matmul FLOPs at 790 TFLOP/s)\n");
  print_flop_timing("forward (3 GEMMs + gate)",
                    median_ms(
                        [&](cudaStream_t s) {
                          shared_expert_forward_cuda(gemm, bf16_ptr(x_d), bf16_ptr(gate_d), bf16_ptr(up_d),
                                                     bf16_ptr(down_d), bf16_ptr(eg_d), bf16_ptr(y_d), false, T, C, I,
                                                     fwd_ws.data(), fwd_ws.bytes(), s);
                        },
                        nullptr),
                    3 * matmul);
  print_flop_timing("backward (recompute 3 + 6 GEMMs)",
                    median_ms(
                        [&](cudaStream_t s) {
                          shared_expert_backward_cuda(gemm, bf16_ptr(x_d), bf16_ptr(gate_d), bf16_ptr(up_d),
                                                      bf16_ptr(down_d), bf16_ptr(eg_d), bf16_ptr(dy_d), bf16_ptr(dx_d),
                                                      false, f32_ptr(dg_d), f32_ptr(du_d), f32_ptr(dd_d), f32_ptr(de_d),
                                                      T, C, I, bwd_ws.data(), bwd_ws.bytes(), s);
                        },
                        nullptr),
                    9 * matmul);
  device_synchronize();
}

}  // namespace
}  // namespace deltamoe
