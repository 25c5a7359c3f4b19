// GPU test of GELU (exact and tanh) with and without the fused bias add and bias gradient, against
// the fp32 references on the same bf16 inputs; timing at the vision MLP (6,272 x 4304, tanh) and
// the merger (1,568 x 4608, exact) for 8 images of 448x448.
#include <gtest/gtest.h>

#include "kernels/bias_add/bias_add.h"
#include "kernels/gelu/gelu.h"
#include "kernels/gelu/gelu_cuda.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"

namespace deltamoe {
namespace {

const char* kind_name(GeluKind kind) { return kind == GeluKind::exact ? "exact" : "tanh"; }

void check_gelu(GeluKind kind, int64_t rows, int64_t features, bool with_bias, uint64_t seed) {
  std::printf("gelu %s rows=%lld features=%lld bias=%d\n", kind_name(kind), static_cast<long long>(rows),
              static_cast<long long>(features), with_bias);
  const int64_t count = rows * features;
  HostTensor x = random_bf16_exact({rows, features}, seed, 3.0f);  // wide enough to reach both tails
  HostTensor bias = random_bf16_exact({features}, seed + 1, 0.5f);
  HostTensor dy = random_bf16_exact({rows, features}, seed + 2);
  HostTensor db_init = random_normal_tensor({features}, seed + 3);

  // h: the activation input as stored in bf16 (the linear's output plus its bias).
  HostTensor h(DType::f32, {rows, features});
  for (int64_t i = 0; i < count; ++i)
    h.as<float>()[i] = with_bias ? round_to_bf16(x.as<float>()[i] + bias.as<float>()[i % features]) : x.as<float>()[i];
  HostTensor y_ref(DType::f32, {rows, features}), dx_ref(DType::f32, {rows, features});
  HostTensor db_ref = random_normal_tensor({features}, seed + 3);
  gelu_forward_ref(kind, h.as<float>(), y_ref.as<float>(), count);
  gelu_backward_ref(kind, h.as<float>(), dy.as<float>(), dx_ref.as<float>(), count);
  bias_add_backward_ref(dx_ref.as<float>(), db_ref.as<float>(), rows, features);

  DeviceTensor x_d = to_device(x, DType::bf16), bias_d = to_device(bias, DType::bf16);
  DeviceTensor h_d = to_device(h, DType::bf16), dy_d = to_device(dy, DType::bf16);
  DeviceTensor db_d = to_device(db_init, DType::f32);
  DeviceTensor pre_d = poisoned_device_tensor(DType::bf16, {rows, features});
  DeviceTensor y_d = poisoned_device_tensor(DType::bf16, {rows, features});
  DeviceTensor dx_d = poisoned_device_tensor(DType::bf16, {rows, features});
  DeviceBuffer workspace(gelu_backward_workspace_bytes(rows, features, with_bias));

  gelu_forward_cuda(kind, bf16_ptr(x_d), with_bias ? bf16_ptr(bias_d) : nullptr, with_bias ? bf16_ptr(pre_d) : nullptr,
                    bf16_ptr(y_d), rows, features, nullptr);
  gelu_backward_cuda(kind, bf16_ptr(h_d), bf16_ptr(dy_d), bf16_ptr(dx_d), with_bias ? f32_ptr(db_d) : nullptr, rows,
                     features, workspace.data(), workspace.bytes(), nullptr);
  device_synchronize();

  if (with_bias) {
    CompareResult pre = compare_tensors("pre_out = bf16(x + bias)", to_host(pre_d.view), h);
    EXPECT_EQ(pre.max_abs_diff, 0.0);  // one correctly rounded add on both sides
    EXPECT_TRUE(pre.all_finite);
    expect_close("d_bias (f32, added to)", db_d, db_ref, 1e-4);
  }
  expect_close("y (bf16)", y_d, y_ref, 1e-2);
  expect_close("dx (bf16)", dx_d, dx_ref, 1e-2);
}

TEST(GeluGpu, MatchesReferenceOverShapes) {
  for (GeluKind kind : {GeluKind::tanh, GeluKind::exact}) {
    check_gelu(kind, 1, 4304, true, 10);      // one patch at the MLP width
    check_gelu(kind, 37, 129, true, 20);      // odd width: scalar paths
    check_gelu(kind, 37, 129, false, 30);
    check_gelu(kind, 1024, 4304, true, 40);   // one 32x32-patch image through fc1
    check_gelu(kind, 3, 5, false, 50);        // tiny, odd count
    check_gelu(kind, 5000, 40, true, 60);     // many rows: many bias-gradient chunks
  }
  check_gelu(GeluKind::exact, (3072 + 1024) / 4, 4608, true, 70);  // merger fc1 for 64x48 + 32x32 images
}

// In place as the vision MLP uses it: pre_out over x, and dx over dy.
TEST(GeluGpu, InPlaceMatchesReference) {
  const int64_t rows = 77, features = 4304;
  HostTensor x = random_bf16_exact({rows, features}, 80, 3.0f), bias = random_bf16_exact({features}, 81, 0.5f);
  HostTensor dy = random_bf16_exact({rows, features}, 82);
  HostTensor h(DType::f32, {rows, features}), y_ref(DType::f32, {rows, features});
  HostTensor dx_ref(DType::f32, {rows, features}), db_ref(DType::f32, {features});
  for (int64_t i = 0; i < rows * features; ++i)
    h.as<float>()[i] = round_to_bf16(x.as<float>()[i] + bias.as<float>()[i % features]);
  gelu_forward_ref(GeluKind::tanh, h.as<float>(), y_ref.as<float>(), rows * features);
  gelu_backward_ref(GeluKind::tanh, h.as<float>(), dy.as<float>(), dx_ref.as<float>(), rows * features);
  bias_add_backward_ref(dx_ref.as<float>(), db_ref.as<float>(), rows, features);
  DeviceTensor x_d = to_device(x, DType::bf16), bias_d = to_device(bias, DType::bf16);
  DeviceTensor dy_d = to_device(dy, DType::bf16), db_d = device_tensor(DType::f32, {features});
  device_fill_bytes(db_d.view, 0);
  DeviceTensor y_d = poisoned_device_tensor(DType::bf16, {rows, features});
  DeviceBuffer workspace(gelu_backward_workspace_bytes(rows, features, true));
  gelu_forward_cuda(GeluKind::tanh, bf16_ptr(x_d), bf16_ptr(bias_d), bf16_ptr(x_d), bf16_ptr(y_d), rows, features,
                    nullptr);
  gelu_backward_cuda(GeluKind::tanh, bf16_ptr(x_d), bf16_ptr(dy_d), bf16_ptr(dy_d), f32_ptr(db_d), rows, features,
                     workspace.data(), workspace.bytes(), nullptr);
  device_synchronize();
  CompareResult pre = compare_tensors("x overwritten by bf16(x + bias)", to_host(x_d.view), h);
  EXPECT_EQ(pre.max_abs_diff, 0.0);
  expect_close("y (bf16)", y_d, y_ref, 1e-2);
  expect_close("dx over dy (bf16)", dy_d, dx_ref, 1e-2);
  expect_close("d_bias from zero (f32)", db_d, db_ref, 1e-4);
}

TEST(GeluGpu, BadArgumentsAreRejected) {
  DeviceTensor t = device_tensor(DType::bf16, {4, 8});
  DeviceTensor r = device_tensor(DType::f32, {8});
  // pre_out without a bias
  EXPECT_THROW(gelu_forward_cuda(GeluKind::tanh, bf16_ptr(t), nullptr, bf16_ptr(t), bf16_ptr(t), 4, 8, nullptr),
               Error);
  // bias gradient without workspace
  EXPECT_THROW(gelu_backward_cuda(GeluKind::tanh, bf16_ptr(t), bf16_ptr(t), bf16_ptr(t), f32_ptr(r), 4, 8, nullptr, 0,
                                  nullptr),
               Error);
  EXPECT_THROW(gelu_forward_cuda(GeluKind::exact, bf16_ptr(t), nullptr, nullptr, bf16_ptr(t), 4, 0, nullptr), Error);
}

TEST(GeluGpu, TimingAtVisionShapes) {
  struct Case {
    const char* name;
    GeluKind kind;
    int64_t rows, features;
  };
  const Case cases[] = {{"block fc1 6272x4304 tanh", GeluKind::tanh, 6272, 4304},
                        {"merger fc1 1568x4608 exact", GeluKind::exact, 6272 / 4, 4608}};
  for (const Case& c : cases) {
    DeviceTensor x = tiled_random_device_tensor({c.rows, c.features}, 1, 2.0f);
    DeviceTensor dy = tiled_random_device_tensor({c.rows, c.features}, 2, 1.0f);
    DeviceTensor bias = to_device(random_normal_tensor({c.features}, 3, 0.1f), DType::bf16);
    DeviceTensor pre = device_tensor(DType::bf16, {c.rows, c.features});
    DeviceTensor y = device_tensor(DType::bf16, {c.rows, c.features});
    DeviceTensor dx = device_tensor(DType::bf16, {c.rows, c.features});
    DeviceTensor db = device_tensor(DType::f32, {c.features});
    DeviceBuffer workspace(gelu_backward_workspace_bytes(c.rows, c.features, true));
    const double tensor_bytes = static_cast<double>(c.rows) * c.features * 2;
    std::string base = c.name;
    double fwd = median_ms([&](cudaStream_t s) {
      gelu_forward_cuda(c.kind, bf16_ptr(x), bf16_ptr(bias), bf16_ptr(pre), bf16_ptr(y), c.rows, c.features, s);
    }, nullptr);
    print_bandwidth_timing((base + " fwd +bias (x -> h, y)").c_str(), fwd, 3 * tensor_bytes);
    double bwd = median_ms([&](cudaStream_t s) {
      gelu_backward_cuda(c.kind, bf16_ptr(pre), bf16_ptr(dy), bf16_ptr(dx), nullptr, c.rows, c.features, nullptr, 0, s);
    }, nullptr);
    print_bandwidth_timing((base + " bwd").c_str(), bwd, 3 * tensor_bytes);
    double bwd_bias = median_ms([&](cudaStream_t s) {
      gelu_backward_cuda(c.kind, bf16_ptr(pre), bf16_ptr(dy), bf16_ptr(dx), f32_ptr(db), c.rows, c.features,
                         workspace.data(), workspace.bytes(), s);
    }, nullptr);
    print_bandwidth_timing((base + " bwd + d_bias").c_str(), bwd_bias, 3 * tensor_bytes);
  }
}

}  // namespace
}  // namespace deltamoe
