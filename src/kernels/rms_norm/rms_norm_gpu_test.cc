// GPU test of the zero-centred RMSNorm (plain and residual-fused, forward and backward) against
// the fp32 reference on the same bf16 inputs; timing at the 35B widths for 8192 tokens.
#include <gtest/gtest.h>

#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/rms_norm/rms_norm.h"
#include "kernels/rms_norm/rms_norm_cuda.h"

namespace deltamoe {
namespace {

constexpr double kEps = 1e-6;

void check_rms_norm(int64_t rows, int64_t width, bool fused_residual, bool with_skip, uint64_t seed) {
  std::printf("rms_norm rows=%lld width=%lld residual=%d d_skip=%d\n", static_cast<long long>(rows),
              static_cast<long long>(width), fused_residual, with_skip);
  HostTensor x = random_bf16_exact({rows, width}, seed, 2.0f);
  HostTensor residual = random_bf16_exact({rows, width}, seed + 1);
  HostTensor weight = random_bf16_exact({width}, seed + 2, 0.3f);
  HostTensor dy = random_bf16_exact({rows, width}, seed + 3);
  HostTensor d_skip = random_bf16_exact({rows, width}, seed + 4);
  HostTensor dw_init = random_normal_tensor({width}, seed + 5);

  // The normalised input: x, or bf16(x + residual) as the stored residual stream is.
  HostTensor s(DType::f32, {rows, width});
  for (int64_t i = 0; i < rows * width; ++i)
    s.as<float>()[i] = fused_residual ? round_to_bf16(x.as<float>()[i] + residual.as<float>()[i]) : x.as<float>()[i];
  HostTensor y_ref(DType::f32, {rows, width}), rstd_ref(DType::f32, {rows}), dx_ref(DType::f32, {rows, width});
  HostTensor dw_ref = random_normal_tensor({width}, seed + 5);
  rms_norm_forward_ref(s.as<float>(), weight.as<float>(), y_ref.as<float>(), rstd_ref.as<float>(), rows, width, kEps);
  rms_norm_backward_ref(s.as<float>(), weight.as<float>(), rstd_ref.as<float>(), dy.as<float>(), dx_ref.as<float>(),
                        dw_ref.as<float>(), rows, width);
  if (with_skip)
    for (int64_t i = 0; i < rows * width; ++i) dx_ref.as<float>()[i] += d_skip.as<float>()[i];

  DeviceTensor x_d = to_device(x, DType::bf16), residual_d = to_device(residual, DType::bf16);
  DeviceTensor weight_d = to_device(weight, DType::bf16), dy_d = to_device(dy, DType::bf16);
  DeviceTensor skip_d = to_device(d_skip, DType::bf16), dw_d = to_device(dw_init, DType::f32);
  DeviceTensor sum_d = poisoned_device_tensor(DType::bf16, {rows, width});
  DeviceTensor y_d = poisoned_device_tensor(DType::bf16, {rows, width});
  DeviceTensor rstd_d = poisoned_device_tensor(DType::f32, {rows});
  DeviceTensor dx_d = poisoned_device_tensor(DType::bf16, {rows, width});
  DeviceBuffer workspace(rms_norm_backward_workspace_bytes(rows, width));

  rms_norm_forward_cuda(bf16_ptr(x_d), fused_residual ? bf16_ptr(residual_d) : nullptr,
                        fused_residual ? bf16_ptr(sum_d) : nullptr, bf16_ptr(weight_d), bf16_ptr(y_d), f32_ptr(rstd_d),
                        rows, width, kEps, nullptr);
  const __nv_bfloat16* normalised = fused_residual ? bf16_ptr(sum_d) : bf16_ptr(x_d);
  rms_norm_backward_cuda(normalised, bf16_ptr(weight_d), f32_ptr(rstd_d), bf16_ptr(dy_d),
                         with_skip ? bf16_ptr(skip_d) : nullptr, bf16_ptr(dx_d), f32_ptr(dw_d), rows, width,
                         workspace.data(), workspace.bytes(), nullptr);
  device_synchronize();

  if (fused_residual) {
    // bf16(x + r) is one correctly rounded add on both sides: bit-exact.
    CompareResult sum = compare_tensors("sum_out = bf16(x + residual)", to_host(sum_d.view), s);
    EXPECT_EQ(sum.max_abs_diff, 0.0);
    EXPECT_TRUE(sum.all_finite);
  }
  expect_close("y (bf16)", y_d, y_ref, 1e-2);
  expect_close("rstd (f32)", rstd_d, rstd_ref, 1e-5);  // fp32 sums in another order only
  expect_close("dx (bf16)", dx_d, dx_ref, 1e-2);
  expect_close("d_weight (f32, added to)", dw_d, dw_ref, 1e-4);
}

TEST(RmsNormGpu, MatchesReferenceOverShapes) {
  check_rms_norm(1, 2048, false, false, 10);      // T = 1 at the hidden width
  check_rms_norm(37, 129, false, false, 20);      // odd width: scalar path
  check_rms_norm(300, 64, true, true, 30);        // fused residual + skip gradient
  check_rms_norm(513, 2048, true, false, 40);     // decoder norm at the 35B hidden width
  check_rms_norm(50 * 16, 256, false, false, 50); // per-head q_norm: 50 tokens x 16 heads, D 256
  check_rms_norm(3, 8, false, true, 60);          // tiny, single chunk
  check_rms_norm(20000, 24, false, false, 70);    // many rows: many d_weight chunks
}

// q_norm read straight from q_proj's output [T * H, 2D] (query half, stride 2D), its dx written
// into the query half of the q_proj output gradient; the gate half must stay untouched.
TEST(RmsNormGpu, StridedPerHeadNormMatchesReference) {
  const int64_t rows = 45 * 16, width = 256, stride = 2 * width;
  std::printf("strided q_norm rows=%lld width=%lld stride=%lld\n", static_cast<long long>(rows),
              static_cast<long long>(width), static_cast<long long>(stride));
  HostTensor q_out = random_bf16_exact({rows, stride}, 80, 2.0f);
  HostTensor weight = random_bf16_exact({width}, 81, 0.3f);
  HostTensor dy = random_bf16_exact({rows, width}, 82);
  HostTensor query(DType::f32, {rows, width});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) query.as<float>()[r * width + c] = q_out.as<float>()[r * stride + c];
  HostTensor y_ref(DType::f32, {rows, width}), rstd_ref(DType::f32, {rows}), dx_ref(DType::f32, {rows, width});
  HostTensor dw_ref(DType::f32, {width});
  rms_norm_forward_ref(query.as<float>(), weight.as<float>(), y_ref.as<float>(), rstd_ref.as<float>(), rows, width,
                       kEps);
  rms_norm_backward_ref(query.as<float>(), weight.as<float>(), rstd_ref.as<float>(), dy.as<float>(),
                        dx_ref.as<float>(), dw_ref.as<float>(), rows, width);
  DeviceTensor q_d = to_device(q_out, DType::bf16), weight_d = to_device(weight, DType::bf16);
  DeviceTensor dy_d = to_device(dy, DType::bf16);
  DeviceTensor y_d = poisoned_device_tensor(DType::bf16, {rows, width});
  DeviceTensor rstd_d = poisoned_device_tensor(DType::f32, {rows});
  DeviceTensor d_q = poisoned_device_tensor(DType::bf16, {rows, stride});
  HostTensor zeros(DType::f32, {width});
  DeviceTensor dw_d = to_device(zeros, DType::f32);
  DeviceBuffer workspace(rms_norm_backward_workspace_bytes(rows, width));
  rms_norm_forward_strided_cuda(bf16_ptr(q_d), stride, bf16_ptr(weight_d), bf16_ptr(y_d), f32_ptr(rstd_d), rows,
                                width, kEps, nullptr);
  rms_norm_backward_strided_cuda(bf16_ptr(q_d), stride, bf16_ptr(weight_d), f32_ptr(rstd_d), bf16_ptr(dy_d), nullptr,
                                 bf16_ptr(d_q), stride, f32_ptr(dw_d), rows, width, workspace.data(),
                                 workspace.bytes(), nullptr);
  device_synchronize();
  expect_close("y (bf16)", y_d, y_ref, 1e-2);
  expect_close("rstd (f32)", rstd_d, rstd_ref, 1e-5);
  expect_close("d_weight (f32)", dw_d, dw_ref, 1e-4);
  HostTensor d_q_host = to_host(d_q.view).to_f32();
  HostTensor dx_got(DType::f32, {rows, width});
  bool gate_half_untouched = true;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) {
      dx_got.as<float>()[r * width + c] = d_q_host.as<float>()[r * stride + c];
      gate_half_untouched = gate_half_untouched && std::isnan(d_q_host.as<float>()[r * stride + width + c]);
    }
  CompareResult dx = compare_tensors("dx in the q_proj gradient (bf16)", dx_got, dx_ref);
  EXPECT_TRUE(dx.all_finite);
  EXPECT_LE(dx.rel_l2, 1e-2);
  EXPECT_TRUE(gate_half_untouched) << "the strided backward wrote into the gate half";
}

TEST(RmsNormGpu, BadArgumentsAreRejected) {
  DeviceTensor t = device_tensor(DType::bf16, {4, 8});
  DeviceTensor r = device_tensor(DType::f32, {4});
  EXPECT_THROW(rms_norm_forward_cuda(bf16_ptr(t), bf16_ptr(t), nullptr, bf16_ptr(t), bf16_ptr(t), f32_ptr(r), 4, 8,
                                     kEps, nullptr),
               Error);
  EXPECT_THROW(rms_norm_backward_cuda(bf16_ptr(t), bf16_ptr(t), f32_ptr(r), bf16_ptr(t), nullptr, bf16_ptr(t),
                                      f32_ptr(r), 4, 8, nullptr, 0, nullptr),
               Error);
}

TEST(RmsNormGpu, TimingAt35BShapes) {
  struct Case {
    const char* name;
    int64_t rows, width;
  };
  const Case cases[] = {{"decoder norm 8192x2048", 8192, 2048}, {"q_norm 8192x16 heads x256", 8192 * 16, 256}};
  for (const Case& c : cases) {
    DeviceTensor x = to_device(random_normal_tensor({c.rows, c.width}, 1), DType::bf16);
    DeviceTensor res = to_device(random_normal_tensor({c.rows, c.width}, 2), DType::bf16);
    DeviceTensor w = to_device(random_normal_tensor({c.width}, 3, 0.1f), DType::bf16);
    DeviceTensor dy = to_device(random_normal_tensor({c.rows, c.width}, 4), DType::bf16);
    DeviceTensor y = device_tensor(DType::bf16, {c.rows, c.width}), sum = device_tensor(DType::bf16, {c.rows, c.width});
    DeviceTensor dx = device_tensor(DType::bf16, {c.rows, c.width});
    DeviceTensor rstd = device_tensor(DType::f32, {c.rows}), dw = device_tensor(DType::f32, {c.width});
    DeviceBuffer workspace(rms_norm_backward_workspace_bytes(c.rows, c.width));
    const double tensor_bytes = static_cast<double>(c.rows) * c.width * 2;
    std::string base = c.name;
    double fwd = median_ms([&](cudaStream_t s) {
      rms_norm_forward_cuda(bf16_ptr(x), nullptr, nullptr, bf16_ptr(w), bf16_ptr(y), f32_ptr(rstd), c.rows, c.width,
                            kEps, s);
    }, nullptr);
    print_bandwidth_timing((base + " fwd").c_str(), fwd, 2 * tensor_bytes);
    double fused = median_ms([&](cudaStream_t s) {
      rms_norm_forward_cuda(bf16_ptr(x), bf16_ptr(res), bf16_ptr(sum), bf16_ptr(w), bf16_ptr(y), f32_ptr(rstd),
                            c.rows, c.width, kEps, s);
    }, nullptr);
    print_bandwidth_timing((base + " fwd + residual").c_str(), fused, 4 * tensor_bytes);
    double bwd = median_ms([&](cudaStream_t s) {
      rms_norm_backward_cuda(bf16_ptr(x), bf16_ptr(w), f32_ptr(rstd), bf16_ptr(dy), nullptr, bf16_ptr(dx),
                             f32_ptr(dw), c.rows, c.width, workspace.data(), workspace.bytes(), s);
    }, nullptr);
    print_bandwidth_timing((base + " bwd (dx + d_weight)").c_str(), bwd, 3 * tensor_bytes);
  }
}

}  // namespace
}  // namespace deltamoe
