// GPU test of the vision LayerNorm over the fp32 stream (plain and with the fused add of a bf16
// block output; backward with the fp32 stream gradient, its bf16 copy, d_weight / d_bias and the
// column sums of d_skip and dx) against the fp32 reference; timing at the tower's width for 8
// images of 448x448 (6,272 patches).
#include <gtest/gtest.h>

#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/layer_norm/layer_norm.h"
#include "kernels/layer_norm/layer_norm_cuda.h"

namespace deltamoe {
namespace {

constexpr double kEps = 1e-6;  // the vision tower's LayerNorm eps

// dy_f32: the gradient of y arrives in fp32 (a product's fp32 output).
void check_layer_norm(int64_t rows, int64_t hidden, bool fused_add, bool with_skip, uint64_t seed,
                      bool dy_f32 = false) {
  std::printf("layer_norm rows=%lld hidden=%lld add=%d d_skip=%d dy_f32=%d\n", static_cast<long long>(rows),
              static_cast<long long>(hidden), fused_add, with_skip, dy_f32);
  HostTensor residual = random_normal_tensor({rows, hidden}, seed, 2.0f);
  // A common offset per row so that the mean matters.
  for (int64_t i = 0; i < rows * hidden; ++i) residual.as<float>()[i] += 1.5f;
  HostTensor delta = random_bf16_exact({rows, hidden}, seed + 1);
  HostTensor weight = random_normal_tensor({hidden}, seed + 2, 0.5f);
  HostTensor bias = random_normal_tensor({hidden}, seed + 3, 0.2f);
  HostTensor dy = dy_f32 ? random_normal_tensor({rows, hidden}, seed + 4) : random_bf16_exact({rows, hidden}, seed + 4);
  HostTensor d_skip = random_normal_tensor({rows, hidden}, seed + 5);
  HostTensor dw_init = random_normal_tensor({hidden}, seed + 6);
  HostTensor db_init = random_normal_tensor({hidden}, seed + 7);
  HostTensor skip_sum_init = random_normal_tensor({hidden}, seed + 8);
  HostTensor dx_sum_init = random_normal_tensor({hidden}, seed + 9);

  HostTensor s(DType::f32, {rows, hidden});
  for (int64_t i = 0; i < rows * hidden; ++i)
    s.as<float>()[i] = residual.as<float>()[i] + (fused_add ? delta.as<float>()[i] : 0.0f);
  HostTensor y_ref(DType::f32, {rows, hidden}), mean_ref(DType::f32, {rows}), rstd_ref(DType::f32, {rows});
  HostTensor dx_ref(DType::f32, {rows, hidden});
  HostTensor dw_ref = random_normal_tensor({hidden}, seed + 6), db_ref = random_normal_tensor({hidden}, seed + 7);
  layer_norm_forward_ref(s.as<float>(), weight.as<float>(), bias.as<float>(), y_ref.as<float>(), mean_ref.as<float>(),
                         rstd_ref.as<float>(), rows, hidden, kEps);
  layer_norm_backward_ref(s.as<float>(), weight.as<float>(), mean_ref.as<float>(), rstd_ref.as<float>(),
                          dy.as<float>(), dx_ref.as<float>(), dw_ref.as<float>(), db_ref.as<float>(), rows, hidden);
  if (with_skip)
    for (int64_t i = 0; i < rows * hidden; ++i) dx_ref.as<float>()[i] += d_skip.as<float>()[i];
  // The stream-bias sums, added to their initial values: column sums of d_skip and of dx, in fp64.
  HostTensor skip_sum_ref(DType::f32, {hidden}), dx_sum_ref(DType::f32, {hidden});
  for (int64_t c = 0; c < hidden; ++c) {
    double skip_total = skip_sum_init.as<float>()[c], dx_total = dx_sum_init.as<float>()[c];
    for (int64_t r = 0; r < rows; ++r) {
      skip_total += d_skip.as<float>()[r * hidden + c];
      dx_total += dx_ref.as<float>()[r * hidden + c];
    }
    skip_sum_ref.as<float>()[c] = static_cast<float>(skip_total);
    dx_sum_ref.as<float>()[c] = static_cast<float>(dx_total);
  }

  DeviceTensor residual_d = to_device(residual, DType::f32), delta_d = to_device(delta, DType::bf16);
  DeviceTensor weight_d = to_device(weight, DType::f32), bias_d = to_device(bias, DType::f32);
  DeviceTensor dy_d = to_device(dy, dy_f32 ? DType::f32 : DType::bf16), skip_d = to_device(d_skip, DType::f32);
  DeviceTensor dw_d = to_device(dw_init, DType::f32), db_d = to_device(db_init, DType::f32);
  DeviceTensor skip_sum_d = to_device(skip_sum_init, DType::f32), dx_sum_d = to_device(dx_sum_init, DType::f32);
  DeviceTensor sum_d = poisoned_device_tensor(DType::f32, {rows, hidden});
  DeviceTensor y_d = poisoned_device_tensor(DType::bf16, {rows, hidden});
  DeviceTensor mean_d = poisoned_device_tensor(DType::f32, {rows});
  DeviceTensor rstd_d = poisoned_device_tensor(DType::f32, {rows});
  DeviceTensor dx_d = poisoned_device_tensor(DType::f32, {rows, hidden});
  DeviceTensor dx_bf16_d = poisoned_device_tensor(DType::bf16, {rows, hidden});
  DeviceBuffer workspace(layer_norm_backward_workspace_bytes(rows, hidden));

  layer_norm_forward_cuda(fused_add ? bf16_ptr(delta_d) : nullptr, f32_ptr(residual_d),
                          fused_add ? f32_ptr(sum_d) : nullptr, f32_ptr(weight_d), f32_ptr(bias_d), bf16_ptr(y_d),
                          f32_ptr(mean_d), f32_ptr(rstd_d), rows, hidden, kEps, nullptr);
  const float* normalised = fused_add ? f32_ptr(sum_d) : f32_ptr(residual_d);
  const float* skip = with_skip ? f32_ptr(skip_d) : nullptr;
  const LayerNormStreamBiasGrads sums{.of_d_skip = with_skip ? f32_ptr(skip_sum_d) : nullptr,
                                      .of_dx = f32_ptr(dx_sum_d)};
  if (dy_f32) {
    layer_norm_backward_cuda(normalised, f32_ptr(weight_d), f32_ptr(mean_d), f32_ptr(rstd_d), f32_ptr(dy_d), skip,
                             f32_ptr(dx_d), bf16_ptr(dx_bf16_d), f32_ptr(dw_d), f32_ptr(db_d), sums, rows, hidden,
                             workspace.data(), workspace.bytes(), nullptr);
  } else {
    layer_norm_backward_cuda(normalised, f32_ptr(weight_d), f32_ptr(mean_d), f32_ptr(rstd_d), bf16_ptr(dy_d), skip,
                             f32_ptr(dx_d), bf16_ptr(dx_bf16_d), f32_ptr(dw_d), f32_ptr(db_d), sums, rows, hidden,
                             workspace.data(), workspace.bytes(), nullptr);
  }
  device_synchronize();

  if (fused_add) {
    // residual + delta is one correctly rounded fp32 add on both sides: bit-exact.
    CompareResult sum = compare_tensors("sum_out = residual + delta (f32)", to_host(sum_d.view), s);
    EXPECT_EQ(sum.max_abs_diff, 0.0);
    EXPECT_TRUE(sum.all_finite);
  }
  expect_close("y (bf16)", y_d, y_ref, 1e-2);
  expect_close("mean (f32)", mean_d, mean_ref, 1e-5);  // fp32 sums in another order only
  expect_close("rstd (f32)", rstd_d, rstd_ref, 1e-5);
  expect_close("dx (f32)", dx_d, dx_ref, 1e-5);
  expect_close("dx bf16 copy", dx_bf16_d, dx_ref, 1e-2);
  expect_close("d_weight (f32, added to)", dw_d, dw_ref, 1e-4);
  expect_close("d_bias (f32, added to)", db_d, db_ref, 1e-4);
  if (with_skip) expect_close("column sums of d_skip (f32, added to)", skip_sum_d, skip_sum_ref, 1e-5);
  expect_close("column sums of dx (f32, added to)", dx_sum_d, dx_sum_ref, 1e-4);
}

TEST(LayerNormGpu, MatchesReferenceOverShapes) {
  check_layer_norm(1, 1152, false, false, 10);       // one patch at the tower width
  check_layer_norm(37, 129, false, false, 20);       // odd width: scalar path
  check_layer_norm(300, 64, true, true, 30);         // fused add + skip gradient
  check_layer_norm(300, 1152, true, true, 35, true); // fp32 dy (the vision blocks' norm backwards)
  check_layer_norm(41, 71, false, false, 36, true);  // fp32 dy, scalar path
  check_layer_norm(1024, 1152, true, false, 40);     // one 32x32-patch image, norm2 after the residual add
  check_layer_norm(3072 + 1024, 1152, false, true, 50);  // 64x48 + 32x32 images packed
  check_layer_norm(256, 3072, false, true, 60);      // the widest row one pass takes with 16-byte vectors
  check_layer_norm(3, 8, false, true, 70);           // tiny, single chunk
  check_layer_norm(20000, 24, false, false, 80);     // many rows: many parameter-gradient chunks
  check_layer_norm(1021, 1000, false, true, 85);     // a part-idle last warp; rows not a multiple of the group
}

TEST(LayerNormGpu, ParameterGradientsAreOptional) {
  const int64_t rows = 50, hidden = 96;
  HostTensor x = random_normal_tensor({rows, hidden}, 90), w = random_normal_tensor({hidden}, 91);
  HostTensor b = random_normal_tensor({hidden}, 92), dy = random_bf16_exact({rows, hidden}, 93);
  HostTensor y_ref(DType::f32, {rows, hidden}), mean_ref(DType::f32, {rows}), rstd_ref(DType::f32, {rows});
  HostTensor dx_ref(DType::f32, {rows, hidden});
  layer_norm_forward_ref(x.as<float>(), w.as<float>(), b.as<float>(), y_ref.as<float>(), mean_ref.as<float>(),
                         rstd_ref.as<float>(), rows, hidden, kEps);
  layer_norm_backward_ref<float>(x.as<float>(), w.as<float>(), mean_ref.as<float>(), rstd_ref.as<float>(),
                                 dy.as<float>(), dx_ref.as<float>(), nullptr, nullptr, rows, hidden);
  DeviceTensor x_d = to_device(x, DType::f32), w_d = to_device(w, DType::f32), dy_d = to_device(dy, DType::bf16);
  DeviceTensor mean_d = to_device(mean_ref), rstd_d = to_device(rstd_ref);
  DeviceTensor dx_d = poisoned_device_tensor(DType::f32, {rows, hidden});
  // No workspace is needed without parameter gradients; no bf16 copy asked for.
  layer_norm_backward_cuda(f32_ptr(x_d), f32_ptr(w_d), f32_ptr(mean_d), f32_ptr(rstd_d), bf16_ptr(dy_d), nullptr,
                           f32_ptr(dx_d), nullptr, nullptr, nullptr, {}, rows, hidden, nullptr, 0, nullptr);
  device_synchronize();
  expect_close("dx without parameter gradients (f32)", dx_d, dx_ref, 1e-5);
}

TEST(LayerNormGpu, BadArgumentsAreRejected) {
  DeviceTensor t = device_tensor(DType::bf16, {4, 8});
  DeviceTensor f = device_tensor(DType::f32, {4, 8});
  DeviceTensor r = device_tensor(DType::f32, {8});
  // a block output without a place for the new stream
  EXPECT_THROW(layer_norm_forward_cuda(bf16_ptr(t), f32_ptr(f), nullptr, f32_ptr(r), f32_ptr(r), bf16_ptr(t),
                                       f32_ptr(r), f32_ptr(r), 4, 8, kEps, nullptr),
               Error);
  // missing bias
  EXPECT_THROW(layer_norm_forward_cuda(nullptr, f32_ptr(f), nullptr, f32_ptr(r), nullptr, bf16_ptr(t), f32_ptr(r),
                                       f32_ptr(r), 4, 8, kEps, nullptr),
               Error);
  // parameter gradients without workspace
  EXPECT_THROW(layer_norm_backward_cuda(f32_ptr(f), f32_ptr(r), f32_ptr(r), f32_ptr(r), bf16_ptr(t), nullptr,
                                        f32_ptr(f), nullptr, f32_ptr(r), f32_ptr(r), {}, 4, 8, nullptr, 0, nullptr),
               Error);
  // the column sums of a d_skip that is not given
  DeviceBuffer scratch(layer_norm_backward_workspace_bytes(4, 8));
  EXPECT_THROW(layer_norm_backward_cuda(f32_ptr(f), f32_ptr(r), f32_ptr(r), f32_ptr(r), bf16_ptr(t), nullptr,
                                        f32_ptr(f), nullptr, nullptr, nullptr, {.of_d_skip = f32_ptr(r)}, 4, 8,
                                        scratch.data(), scratch.bytes(), nullptr),
               Error);
  // a row wider than one pass takes (3,072 columns with 16-byte vectors)
  DeviceTensor wide = device_tensor(DType::f32, {1, 3080}), wide_w = device_tensor(DType::f32, {3080});
  EXPECT_THROW(layer_norm_backward_cuda(f32_ptr(wide), f32_ptr(wide_w), f32_ptr(r), f32_ptr(r), f32_ptr(wide), nullptr,
                                        f32_ptr(wide), nullptr, nullptr, nullptr, {}, 1, 3080, nullptr, 0, nullptr),
               Error);
  DeviceTensor wide_y = device_tensor(DType::bf16, {1, 3080});
  EXPECT_THROW(layer_norm_forward_cuda(nullptr, f32_ptr(wide), nullptr, f32_ptr(wide_w), f32_ptr(wide_w),
                                       bf16_ptr(wide_y), f32_ptr(r), f32_ptr(r), 1, 3080, kEps, nullptr),
               Error);
}

TEST(LayerNormGpu, WidthsTheKernelsTakeAreKnownUpFront) {
  EXPECT_TRUE(layer_norm_cuda_takes(1152));   // the tower's
  EXPECT_TRUE(layer_norm_cuda_takes(3072));   // the widest with 16-byte vectors
  EXPECT_FALSE(layer_norm_cuda_takes(3080));
  EXPECT_TRUE(layer_norm_cuda_takes(1021));   // unvectorised up to 1,024
  EXPECT_FALSE(layer_norm_cuda_takes(1025));
  EXPECT_FALSE(layer_norm_cuda_takes(0));
}

TEST(LayerNormGpu, TimingAtVisionShapes) {
  const int64_t rows = 8 * 28 * 28, hidden = 1152;  // 8 images of 448x448 at patch 16
  DeviceTensor delta = tiled_random_device_tensor({rows, hidden}, 1, 1.0f);
  DeviceTensor res = to_device(random_normal_tensor({rows, hidden}, 2), DType::f32);
  DeviceTensor w = to_device(random_normal_tensor({hidden}, 3, 0.1f), DType::f32);
  DeviceTensor b = to_device(random_normal_tensor({hidden}, 4, 0.1f), DType::f32);
  DeviceTensor dy = tiled_random_device_tensor({rows, hidden}, 5, 1.0f);
  DeviceTensor y = device_tensor(DType::bf16, {rows, hidden}), sum = device_tensor(DType::f32, {rows, hidden});
  DeviceTensor dx = device_tensor(DType::f32, {rows, hidden}), dx_bf16 = device_tensor(DType::bf16, {rows, hidden});
  DeviceTensor mean = device_tensor(DType::f32, {rows}), rstd = device_tensor(DType::f32, {rows});
  DeviceTensor dw = device_tensor(DType::f32, {hidden}), db = device_tensor(DType::f32, {hidden});
  DeviceTensor skip_sum = device_tensor(DType::f32, {hidden}), dx_sum = device_tensor(DType::f32, {hidden});
  DeviceBuffer workspace(layer_norm_backward_workspace_bytes(rows, hidden));
  const double elements = static_cast<double>(rows) * hidden;
  double fused = median_ms([&](cudaStream_t s) {
    layer_norm_forward_cuda(bf16_ptr(delta), f32_ptr(res), f32_ptr(sum), f32_ptr(w), f32_ptr(b), bf16_ptr(y),
                            f32_ptr(mean), f32_ptr(rstd), rows, hidden, kEps, s);
  }, nullptr);
  print_bandwidth_timing("layer_norm 6272x1152 fwd + residual (f32 stream)", fused, elements * (2 + 4 + 4 + 2));
  double bwd = median_ms([&](cudaStream_t s) {
    layer_norm_backward_cuda(f32_ptr(sum), f32_ptr(w), f32_ptr(mean), f32_ptr(rstd), bf16_ptr(dy), f32_ptr(res),
                             f32_ptr(dx), bf16_ptr(dx_bf16), f32_ptr(dw), f32_ptr(db),
                             {.of_d_skip = f32_ptr(skip_sum), .of_dx = f32_ptr(dx_sum)}, rows, hidden,
                             workspace.data(), workspace.bytes(), s);
  }, nullptr);
  print_bandwidth_timing("layer_norm 6272x1152 bwd (dx f32 + bf16, d_w, d_b, d_skip and dx sums)", bwd,
                         elements * (4 + 2 + 4 + 4 + 2));
  // As in the tower: dy from a product's fp32 output.
  DeviceTensor dy_f32 = to_device(random_normal_tensor({rows, hidden}, 6), DType::f32);
  double bwd_f32 = median_ms([&](cudaStream_t s) {
    layer_norm_backward_cuda(f32_ptr(sum), f32_ptr(w), f32_ptr(mean), f32_ptr(rstd), f32_ptr(dy_f32), f32_ptr(res),
                             f32_ptr(dx), bf16_ptr(dx_bf16), f32_ptr(dw), f32_ptr(db),
                             {.of_d_skip = f32_ptr(skip_sum), .of_dx = f32_ptr(dx_sum)}, rows, hidden,
                             workspace.data(), workspace.bytes(), s);
  }, nullptr);
  print_bandwidth_timing("layer_norm 6272x1152 bwd, fp32 dy (the tower's norm2)", bwd_f32,
                         elements * (4 + 4 + 4 + 4 + 2));
}

}  // namespace
}  // namespace deltamoe
