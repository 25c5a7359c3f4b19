// GPU test of the attention output gate (gate read in place from a q_proj-shaped buffer) and of
// SwiGLU, forward and backward, against the fp32 references; timing at the 35B shapes.
#include <gtest/gtest.h>

#include "kernels/attention/attention.h"
#include "kernels/gate_activations/gate_activations.h"
#include "kernels/gate_activations/gate_activations_cuda.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"

namespace deltamoe {
namespace {

// q_proj output [rows, 2D]: per row the query (first D) then the gate (next D), as Qwen3.5 lays
// out each head. The gate is read from there with row stride 2D.
void check_attention_gate(int64_t rows, int64_t width, uint64_t seed) {
  std::printf("attention gate rows=%lld D=%lld\n", static_cast<long long>(rows), static_cast<long long>(width));
  HostTensor attn = random_bf16_exact({rows, width}, seed);
  HostTensor q_out = random_bf16_exact({rows, 2 * width}, seed + 1, 3.0f);
  HostTensor dy = random_bf16_exact({rows, width}, seed + 2);
  HostTensor gate(DType::f32, {rows, width});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) gate.as<float>()[r * width + c] = q_out.as<float>()[r * 2 * width + width + c];
  HostTensor y_ref(DType::f32, {rows, width}), d_attn_ref(DType::f32, {rows, width}), d_gate_ref(DType::f32, {rows, width});
  attention_gate_forward_ref(attn.as<float>(), gate.as<float>(), y_ref.as<float>(), rows * width);
  attention_gate_backward_ref(attn.as<float>(), gate.as<float>(), dy.as<float>(), d_attn_ref.as<float>(),
                              d_gate_ref.as<float>(), rows * width);

  DeviceTensor attn_d = to_device(attn, DType::bf16), q_d = to_device(q_out, DType::bf16);
  DeviceTensor dy_d = to_device(dy, DType::bf16);
  DeviceTensor y_d = poisoned_device_tensor(DType::bf16, {rows, width});
  DeviceTensor d_attn_d = poisoned_device_tensor(DType::bf16, {rows, width});
  DeviceTensor d_q = poisoned_device_tensor(DType::bf16, {rows, 2 * width});  // gate half gets d_gate
  const __nv_bfloat16* gate_in_place = bf16_ptr(q_d) + width;
  attention_gate_forward_cuda(bf16_ptr(attn_d), gate_in_place, 2 * width, bf16_ptr(y_d), rows, width, nullptr);
  attention_gate_backward_cuda(bf16_ptr(attn_d), gate_in_place, 2 * width, bf16_ptr(dy_d), bf16_ptr(d_attn_d),
                               bf16_ptr(d_q) + width, 2 * width, rows, width, nullptr);
  device_synchronize();
  expect_close("y = o * sigmoid(g) (bf16)", y_d, y_ref, 1e-2);
  expect_close("d_attn (bf16)", d_attn_d, d_attn_ref, 1e-2);
  HostTensor d_q_host = to_host(d_q.view).to_f32();
  HostTensor d_gate_got(DType::f32, {rows, width});
  bool query_half_untouched = true;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) {
      d_gate_got.as<float>()[r * width + c] = d_q_host.as<float>()[r * 2 * width + width + c];
      query_half_untouched &= std::isnan(d_q_host.as<float>()[r * 2 * width + c]);  // still poison
    }
  CompareResult d_gate = compare_tensors("d_gate in the q_proj gradient (bf16)", d_gate_got, d_gate_ref);
  EXPECT_TRUE(d_gate.all_finite);
  EXPECT_LE(d_gate.rel_l2, 1e-2);
  EXPECT_TRUE(query_half_untouched) << "the gate backward wrote into the query half";
}

void check_swiglu(int64_t rows, int64_t intermediate, uint64_t seed) {
  std::printf("swiglu rows=%lld I=%lld\n", static_cast<long long>(rows), static_cast<long long>(intermediate));
  HostTensor gate_up = random_bf16_exact({rows, 2 * intermediate}, seed, 2.0f);
  HostTensor dh = random_bf16_exact({rows, intermediate}, seed + 1);
  HostTensor h_ref(DType::f32, {rows, intermediate}), d_ref(DType::f32, {rows, 2 * intermediate});
  swiglu_forward_ref(gate_up.as<float>(), h_ref.as<float>(), rows, intermediate);
  swiglu_backward_ref(gate_up.as<float>(), dh.as<float>(), d_ref.as<float>(), rows, intermediate);
  DeviceTensor gate_up_d = to_device(gate_up, DType::bf16), dh_d = to_device(dh, DType::bf16);
  DeviceTensor h_d = poisoned_device_tensor(DType::bf16, {rows, intermediate});
  DeviceTensor d_d = poisoned_device_tensor(DType::bf16, {rows, 2 * intermediate});
  swiglu_forward_cuda(bf16_ptr(gate_up_d), bf16_ptr(h_d), rows, intermediate, nullptr);
  swiglu_backward_cuda(bf16_ptr(gate_up_d), bf16_ptr(dh_d), bf16_ptr(d_d), rows, intermediate, nullptr);
  device_synchronize();
  expect_close("h = silu(g) * u (bf16)", h_d, h_ref, 1e-2);
  expect_close("d_gate_up (bf16)", d_d, d_ref, 1e-2);
}

TEST(GateActivationsGpu, AttentionGateMatchesReference) {
  check_attention_gate(1 * 16, 256, 1);   // T = 1, 16 heads, D 256
  check_attention_gate(37 * 3, 13, 2);    // odd width: scalar path
  check_attention_gate(300 * 16, 256, 3); // 300 tokens of the 35B model
}

TEST(GateActivationsGpu, SwigluMatchesReference) {
  check_swiglu(1, 512, 4);     // T = 1, expert width
  check_swiglu(77, 29, 5);     // odd
  check_swiglu(1000, 512, 6);  // 35B expert / shared expert width
}

TEST(GateActivationsGpu, BadStrideIsRejected) {
  DeviceTensor t = device_tensor(DType::bf16, {4, 8});
  EXPECT_THROW(attention_gate_forward_cuda(bf16_ptr(t), bf16_ptr(t), 4, bf16_ptr(t), 4, 8, nullptr), Error);
}

TEST(GateActivationsGpu, TimingAt35BShapes) {
  const int64_t tokens = 8192, heads = 16, head_dim = 256, intermediate = 512, topk = 8;
  {
    const int64_t rows = tokens * heads;
    DeviceTensor attn = to_device(random_normal_tensor({rows, head_dim}, 1), DType::bf16);
    DeviceTensor q = to_device(random_normal_tensor({rows, 2 * head_dim}, 2), DType::bf16);
    DeviceTensor y = device_tensor(DType::bf16, {rows, head_dim});
    double ms = median_ms([&](cudaStream_t s) {
      attention_gate_forward_cuda(bf16_ptr(attn), bf16_ptr(q) + head_dim, 2 * head_dim, bf16_ptr(y), rows, head_dim,
                                  s);
    }, nullptr);
    print_bandwidth_timing("attention gate fwd 8192x16x256", ms, 3.0 * rows * head_dim * 2);
  }
  {
    const int64_t rows = tokens * topk;  // routed expert rows
    DeviceTensor gate_up = to_device(random_normal_tensor({rows, 2 * intermediate}, 3), DType::bf16);
    DeviceTensor dh = to_device(random_normal_tensor({rows, intermediate}, 4), DType::bf16);
    DeviceTensor h = device_tensor(DType::bf16, {rows, intermediate});
    DeviceTensor d = device_tensor(DType::bf16, {rows, 2 * intermediate});
    double fwd = median_ms([&](cudaStream_t s) {
      swiglu_forward_cuda(bf16_ptr(gate_up), bf16_ptr(h), rows, intermediate, s);
    }, nullptr);
    print_bandwidth_timing("swiglu fwd 65536x512 (8192 tokens x top-8)", fwd, 3.0 * rows * intermediate * 2);
    double bwd = median_ms([&](cudaStream_t s) {
      swiglu_backward_cuda(bf16_ptr(gate_up), bf16_ptr(dh), bf16_ptr(d), rows, intermediate, s);
    }, nullptr);
    print_bandwidth_timing("swiglu bwd 65536x512", bwd, 5.0 * rows * intermediate * 2);
  }
}

}  // namespace
}  // namespace deltamoe
