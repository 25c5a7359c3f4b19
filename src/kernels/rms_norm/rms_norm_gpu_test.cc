// GPU test of the zero-centred RMSNorm against the fp32 reference: the residual-stream form (fp32
// stream, optional fused add of a bf16 block output, the output's low part, fp32 dx with its bf16
// copy, bf16 or fp32 dy)
// and the bf16 head form (contiguous and strided), forward and backward; timing at the 35B widths.
#include <gtest/gtest.h>

#include <string>

#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/rms_norm/rms_norm.h"
#include "kernels/rms_norm/rms_norm_cuda.h"
#include "testing/bit_fingerprint.h"

namespace deltamoe {
namespace {

constexpr double kEps = 1e-6;

// The stream form. fused_add: s = residual + delta (fp32, exact on both sides for these values up
// to fp32 rounding); dy_f32: the gradient of y arrives in fp32 (a mixer's summed input gradient).
void check_stream_norm(int64_t rows, int64_t width, bool fused_add, bool with_skip, bool dy_f32, uint64_t seed) {
  std::printf("rms_norm stream rows=%lld width=%lld add=%d d_skip=%d dy_f32=%d\n", static_cast<long long>(rows),
              static_cast<long long>(width), fused_add, with_skip, dy_f32);
  HostTensor residual = random_normal_tensor({rows, width}, seed, 2.0f);  // fp32 values, not bf16-exact
  HostTensor delta = random_bf16_exact({rows, width}, seed + 1);
  HostTensor weight = random_normal_tensor({width}, seed + 2, 0.3f);
  HostTensor dy = dy_f32 ? random_normal_tensor({rows, width}, seed + 3) : random_bf16_exact({rows, width}, seed + 3);
  HostTensor d_skip = random_normal_tensor({rows, width}, seed + 4);
  HostTensor dw_init = random_normal_tensor({width}, seed + 5);

  HostTensor s(DType::f32, {rows, width});
  for (int64_t i = 0; i < rows * width; ++i)
    s.as<float>()[i] = residual.as<float>()[i] + (fused_add ? delta.as<float>()[i] : 0.0f);
  HostTensor y_ref(DType::f32, {rows, width}), rstd_ref(DType::f32, {rows}), dx_ref(DType::f32, {rows, width});
  HostTensor dw_ref = random_normal_tensor({width}, seed + 5);
  rms_norm_forward_ref(s.as<float>(), weight.as<float>(), y_ref.as<float>(), rstd_ref.as<float>(), rows, width, kEps);
  rms_norm_backward_ref(s.as<float>(), weight.as<float>(), rstd_ref.as<float>(), dy.as<float>(), dx_ref.as<float>(),
                        dw_ref.as<float>(), rows, width);
  if (with_skip)
    for (int64_t i = 0; i < rows * width; ++i) dx_ref.as<float>()[i] += d_skip.as<float>()[i];

  DeviceTensor residual_d = to_device(residual, DType::f32), delta_d = to_device(delta, DType::bf16);
  DeviceTensor weight_d = to_device(weight, DType::f32);
  DeviceTensor dy_d = to_device(dy, dy_f32 ? DType::f32 : DType::bf16);
  DeviceTensor skip_d = to_device(d_skip, DType::f32), dw_d = to_device(dw_init, DType::f32);
  DeviceTensor sum_d = poisoned_device_tensor(DType::f32, {rows, width});
  DeviceTensor y_d = poisoned_device_tensor(DType::bf16, {rows, width});
  DeviceTensor rstd_d = poisoned_device_tensor(DType::f32, {rows});
  DeviceTensor dx_d = poisoned_device_tensor(DType::f32, {rows, width});
  DeviceTensor dx_bf16_d = poisoned_device_tensor(DType::bf16, {rows, width});
  DeviceTensor lo_d = poisoned_device_tensor(DType::bf16, {rows, width});
  DeviceBuffer workspace(rms_norm_backward_workspace_bytes(rows, width));

  rms_norm_forward_cuda(fused_add ? bf16_ptr(delta_d) : nullptr, f32_ptr(residual_d),
                        fused_add ? f32_ptr(sum_d) : nullptr, f32_ptr(weight_d), bf16_ptr(y_d), f32_ptr(rstd_d), rows,
                        width, kEps, nullptr);
  const float* normalised = fused_add ? f32_ptr(sum_d) : f32_ptr(residual_d);
  rms_norm_output_low_part_cuda(normalised, f32_ptr(weight_d), f32_ptr(rstd_d), bf16_ptr(y_d), bf16_ptr(lo_d), rows,
                                width, nullptr);
  const float* skip = with_skip ? f32_ptr(skip_d) : nullptr;
  if (dy_f32) {
    rms_norm_backward_cuda(normalised, f32_ptr(weight_d), f32_ptr(rstd_d), f32_ptr(dy_d), skip, f32_ptr(dx_d),
                           bf16_ptr(dx_bf16_d), f32_ptr(dw_d), rows, width, workspace.data(), workspace.bytes(),
                           nullptr);
  } else {
    rms_norm_backward_cuda(normalised, f32_ptr(weight_d), f32_ptr(rstd_d), bf16_ptr(dy_d), skip, f32_ptr(dx_d),
                           bf16_ptr(dx_bf16_d), f32_ptr(dw_d), rows, width, workspace.data(), workspace.bytes(),
                           nullptr);
  }
  device_synchronize();
  // Fingerprints of the results, for comparing two builds of the kernels bit for bit.
  const std::string label = "rows" + std::to_string(rows) + "_width" + std::to_string(width) + "_add" +
                            std::to_string(fused_add) + "_skip" + std::to_string(with_skip) + "_dyf32" +
                            std::to_string(dy_f32);
  for (const auto& [name, tensor] : {std::pair{"y", &y_d}, std::pair{"rstd", &rstd_d}, std::pair{"dx", &dx_d},
                                     std::pair{"dx_bf16", &dx_bf16_d}, std::pair{"d_weight", &dw_d}})
    print_bit_fingerprint(label.c_str(), name, to_host(tensor->view));

  if (fused_add) {
    // residual + delta is one correctly rounded fp32 add on both sides: bit-exact.
    CompareResult sum = compare_tensors("sum_out = residual + delta (f32)", to_host(sum_d.view), s);
    EXPECT_EQ(sum.max_abs_diff, 0.0);
    EXPECT_TRUE(sum.all_finite);
  }
  expect_close("y (bf16)", y_d, y_ref, 1e-2);
  // y + its low part is the fp32 output: only the order of rstd's fp32 sum differs (bf16 alone: ~2e-3).
  HostTensor y_hi_lo = to_host(y_d.view).to_f32();
  const HostTensor lo_host = to_host(lo_d.view).to_f32();
  for (int64_t i = 0; i < rows * width; ++i) y_hi_lo.as<float>()[i] += lo_host.as<float>()[i];
  CompareResult hi_lo = compare_tensors("y + low part (f32)", y_hi_lo, y_ref);
  EXPECT_TRUE(hi_lo.all_finite);
  EXPECT_LE(hi_lo.rel_l2, 1e-5);
  expect_close("rstd (f32)", rstd_d, rstd_ref, 1e-5);  // fp32 sums in another order only
  expect_close("dx (f32)", dx_d, dx_ref, 1e-5);          // fp32 storage: summation order only
  expect_close("dx bf16 copy", dx_bf16_d, dx_ref, 1e-2);
  expect_close("d_weight (f32, added to)", dw_d, dw_ref, 1e-4);
}

// The head form on bf16 rows; row_stride > width reads the query half of q_proj's [T*H, 2D] output
// and writes dx into the query half of its gradient (the gate half must stay untouched).
void check_head_norm(int64_t rows, int64_t width, int64_t stride, uint64_t seed) {
  std::printf("rms_norm head rows=%lld width=%lld stride=%lld\n", static_cast<long long>(rows),
              static_cast<long long>(width), static_cast<long long>(stride));
  HostTensor x_rows = random_bf16_exact({rows, stride}, seed, 2.0f);
  HostTensor weight = random_normal_tensor({width}, seed + 1, 0.3f);
  HostTensor dy = random_bf16_exact({rows, width}, seed + 2);
  HostTensor x(DType::f32, {rows, width});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) x.as<float>()[r * width + c] = x_rows.as<float>()[r * stride + c];
  HostTensor y_ref(DType::f32, {rows, width}), rstd_ref(DType::f32, {rows}), dx_ref(DType::f32, {rows, width});
  HostTensor dw_ref(DType::f32, {width});
  rms_norm_forward_ref(x.as<float>(), weight.as<float>(), y_ref.as<float>(), rstd_ref.as<float>(), rows, width, kEps);
  rms_norm_backward_ref(x.as<float>(), weight.as<float>(), rstd_ref.as<float>(), dy.as<float>(), dx_ref.as<float>(),
                        dw_ref.as<float>(), rows, width);
  DeviceTensor x_d = to_device(x_rows, DType::bf16), weight_d = to_device(weight, DType::f32);
  DeviceTensor dy_d = to_device(dy, DType::bf16);
  DeviceTensor y_d = poisoned_device_tensor(DType::bf16, {rows, width});
  DeviceTensor rstd_d = poisoned_device_tensor(DType::f32, {rows});
  DeviceTensor dx_d = poisoned_device_tensor(DType::bf16, {rows, stride});
  HostTensor zeros(DType::f32, {width});
  DeviceTensor dw_d = to_device(zeros, DType::f32);
  DeviceBuffer workspace(rms_norm_backward_workspace_bytes(rows, width));
  rms_norm_forward_strided_cuda(bf16_ptr(x_d), stride, f32_ptr(weight_d), bf16_ptr(y_d), f32_ptr(rstd_d), rows,
                                width, kEps, nullptr);
  rms_norm_backward_strided_cuda(bf16_ptr(x_d), stride, f32_ptr(weight_d), f32_ptr(rstd_d), bf16_ptr(dy_d),
                                 bf16_ptr(dx_d), stride, f32_ptr(dw_d), rows, width, workspace.data(),
                                 workspace.bytes(), nullptr);
  device_synchronize();
  expect_close("y (bf16)", y_d, y_ref, 1e-2);
  expect_close("rstd (f32)", rstd_d, rstd_ref, 1e-5);
  expect_close("d_weight (f32)", dw_d, dw_ref, 1e-4);
  HostTensor dx_host = to_host(dx_d.view).to_f32();
  HostTensor dx_got(DType::f32, {rows, width});
  bool rest_untouched = true;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < width; ++c) dx_got.as<float>()[r * width + c] = dx_host.as<float>()[r * stride + c];
    for (int64_t c = width; c < stride; ++c) rest_untouched = rest_untouched && std::isnan(dx_host.as<float>()[r * stride + c]);
  }
  CompareResult dx = compare_tensors("dx (bf16)", dx_got, dx_ref);
  EXPECT_TRUE(dx.all_finite);
  EXPECT_LE(dx.rel_l2, 1e-2);
  EXPECT_TRUE(rest_untouched) << "the strided backward wrote outside the normalised half";
}

TEST(RmsNormGpu, StreamFormMatchesReferenceOverShapes) {
  check_stream_norm(1, 2048, false, false, false, 10);   // T = 1 at the hidden width, first layer (no add)
  check_stream_norm(37, 129, true, true, false, 20);     // odd width: scalar path
  check_stream_norm(300, 64, true, true, true, 30);      // fused add + skip gradient, fp32 dy
  check_stream_norm(513, 2048, true, false, false, 40);  // decoder norm at the 35B hidden width
  check_stream_norm(513, 2048, true, true, true, 45);    // input_layernorm backward: fp32 dy + skip
  check_stream_norm(77, 1024, true, true, true, 50);     // rows kept in registers, 4 vectors a lane
  check_stream_norm(33, 4096, true, true, false, 55);    // forward kept (16 vectors), backward re-reads
  check_stream_norm(21, 2304, true, false, true, 58);    // a 256-multiple not kept: the re-reading form
  check_stream_norm(3, 8, false, true, false, 60);       // tiny, single chunk
  check_stream_norm(20000, 24, false, false, true, 70);  // many rows: many d_weight chunks
}

TEST(RmsNormGpu, HeadFormMatchesReference) {
  check_head_norm(50 * 16, 256, 256, 50);  // k_norm: 50 tokens x 16 heads, D 256, contiguous
  check_head_norm(45 * 16, 256, 512, 80);  // q_norm straight from q_proj's output (stride 2D)
  check_head_norm(7, 20, 20, 90);          // odd sizes: scalar path
}

TEST(RmsNormGpu, BadArgumentsAreRejected) {
  DeviceTensor t = device_tensor(DType::bf16, {4, 8});
  DeviceTensor f = device_tensor(DType::f32, {4, 8});
  DeviceTensor r = device_tensor(DType::f32, {4});
  // A block output without a place for the new stream.
  EXPECT_THROW(rms_norm_forward_cuda(bf16_ptr(t), f32_ptr(f), nullptr, f32_ptr(r), bf16_ptr(t), f32_ptr(r), 4, 8,
                                     kEps, nullptr),
               Error);
  // No workspace.
  EXPECT_THROW(rms_norm_backward_cuda(f32_ptr(f), f32_ptr(r), f32_ptr(r), bf16_ptr(t), nullptr, f32_ptr(f), nullptr,
                                      f32_ptr(r), 4, 8, nullptr, 0, nullptr),
               Error);
  // A row stride shorter than the row.
  EXPECT_THROW(rms_norm_forward_strided_cuda(bf16_ptr(t), 4, f32_ptr(r), bf16_ptr(t), f32_ptr(r), 4, 8, kEps, nullptr),
               Error);
}

TEST(RmsNormGpu, TimingAt35BShapes) {
  const int64_t rows = 8192, width = 2048;
  DeviceTensor delta = to_device(random_normal_tensor({rows, width}, 1), DType::bf16);
  DeviceTensor res = to_device(random_normal_tensor({rows, width}, 2), DType::f32);
  DeviceTensor w = to_device(random_normal_tensor({width}, 3, 0.1f), DType::f32);
  DeviceTensor dy = to_device(random_normal_tensor({rows, width}, 4), DType::bf16);
  DeviceTensor y = device_tensor(DType::bf16, {rows, width}), sum = device_tensor(DType::f32, {rows, width});
  DeviceTensor dx = device_tensor(DType::f32, {rows, width}), dx_bf16 = device_tensor(DType::bf16, {rows, width});
  DeviceTensor rstd = device_tensor(DType::f32, {rows}), dw = device_tensor(DType::f32, {width});
  DeviceBuffer workspace(rms_norm_backward_workspace_bytes(rows, width));
  const double elements = static_cast<double>(rows) * width;
  double fused = median_ms([&](cudaStream_t s) {
    rms_norm_forward_cuda(bf16_ptr(delta), f32_ptr(res), f32_ptr(sum), f32_ptr(w), bf16_ptr(y), f32_ptr(rstd), rows,
                          width, kEps, s);
  }, nullptr);
  // delta bf16 + stream f32 read; new stream f32 + y bf16 written.
  print_bandwidth_timing("decoder norm 8192x2048 fwd + residual (f32 stream)", fused, elements * (2 + 4 + 4 + 2));
  double bwd = median_ms([&](cudaStream_t s) {
    rms_norm_backward_cuda(f32_ptr(sum), f32_ptr(w), f32_ptr(rstd), bf16_ptr(dy), f32_ptr(res), f32_ptr(dx),
                           bf16_ptr(dx_bf16), f32_ptr(dw), rows, width, workspace.data(), workspace.bytes(), s);
  }, nullptr);
  // x f32 + dy bf16 + skip f32 read; dx f32 + bf16 copy written (d_weight pass rereads x, dy).
  print_bandwidth_timing("decoder norm 8192x2048 bwd (dx f32 + bf16, d_weight)", bwd, elements * (4 + 2 + 4 + 4 + 2));
  DeviceTensor q = to_device(random_normal_tensor({rows * 16, 256}, 5), DType::bf16);
  DeviceTensor qw = to_device(random_normal_tensor({256}, 6, 0.1f), DType::f32);
  DeviceTensor qy = device_tensor(DType::bf16, {rows * 16, 256}), qr = device_tensor(DType::f32, {rows * 16});
  double head = median_ms([&](cudaStream_t s) {
    rms_norm_forward_strided_cuda(bf16_ptr(q), 256, f32_ptr(qw), bf16_ptr(qy), f32_ptr(qr), rows * 16, 256, kEps, s);
  }, nullptr);
  print_bandwidth_timing("q_norm 8192x16 heads x256 fwd", head, elements * 2 * 2 * 2);
}

}  // namespace
}  // namespace deltamoe
