// GPU test of the bias add (bf16 rows += bias) and its fp32 column-sum backward against the
// references on the same bf16 inputs, incl. a run-to-run bit comparison; timing at the vision
// qkv width (6,272 x 3456) for 8 images of 448x448.
#include <gtest/gtest.h>

#include <cstring>

#include "kernels/bias_add/bias_add.h"
#include "kernels/bias_add/bias_add_cuda.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"

namespace deltamoe {
namespace {

void check_bias_add(int64_t rows, int64_t features, uint64_t seed) {
  std::printf("bias_add rows=%lld features=%lld\n", static_cast<long long>(rows), static_cast<long long>(features));
  HostTensor y = random_bf16_exact({rows, features}, seed);
  HostTensor bias = random_bf16_exact({features}, seed + 1, 0.5f);
  HostTensor dy = random_bf16_exact({rows, features}, seed + 2);
  HostTensor db_init = random_normal_tensor({features}, seed + 3);
  HostTensor y_ref = y.to_f32(), db_ref = random_normal_tensor({features}, seed + 3);
  bias_add_forward_ref(bias.as<float>(), y_ref.as<float>(), rows, features);
  bias_add_backward_ref(dy.as<float>(), db_ref.as<float>(), rows, features);

  DeviceTensor y_d = to_device(y, DType::bf16), bias_d = to_device(bias, DType::bf16);
  DeviceTensor dy_d = to_device(dy, DType::bf16), db_d = to_device(db_init, DType::f32);
  DeviceBuffer workspace(bias_add_backward_workspace_bytes(rows, features));
  // Poisoned scratch: every partial the reduction reads must have been written.
  const TensorView scratch(workspace.data(), DType::u8, {static_cast<int64_t>(workspace.bytes())}, Device::cuda);
  device_fill_bytes(scratch, 0xFF);
  bias_add_forward_cuda(bf16_ptr(bias_d), bf16_ptr(y_d), rows, features, nullptr);
  bias_add_backward_cuda(bf16_ptr(dy_d), f32_ptr(db_d), rows, features, workspace.data(), workspace.bytes(), nullptr);
  device_synchronize();
  // bf16(y + b) is one correctly rounded fp32 add; the reference adds in fp32 without rounding.
  expect_close("y + bias (bf16)", y_d, y_ref, 1e-2);
  expect_close("d_bias (f32, added to)", db_d, db_ref, 1e-4);
}

TEST(BiasAddGpu, MatchesReferenceOverShapes) {
  check_bias_add(1, 1152, 10);         // one patch
  check_bias_add(37, 129, 20);         // odd width: scalar path
  check_bias_add(3, 5, 30);            // tiny
  check_bias_add(1024, 3456, 40);      // qkv bias of one 32x32-patch image (3 x 1152)
  check_bias_add(4096, 1152, 50);      // proj bias of 64x48 + 32x32 images packed
  check_bias_add(20000, 24, 60);       // many rows: many chunks
}

// The bias gradient straight from an fp32 stream gradient (the vision proj / fc2 / patch biases).
TEST(BiasAddGpu, BackwardFromFp32Gradient) {
  const int64_t rows = 777, features = 1152;
  HostTensor dy = random_normal_tensor({rows, features}, 90);
  HostTensor db_ref = random_normal_tensor({features}, 91);
  DeviceTensor db_d = to_device(db_ref, DType::f32), dy_d = to_device(dy, DType::f32);
  bias_add_backward_ref(dy.as<float>(), db_ref.as<float>(), rows, features);
  DeviceBuffer workspace(bias_add_backward_workspace_bytes(rows, features));
  bias_add_backward_cuda(f32_ptr(dy_d), f32_ptr(db_d), rows, features, workspace.data(), workspace.bytes(), nullptr);
  device_synchronize();
  expect_close("d_bias from f32 dy (added to)", db_d, db_ref, 1e-6);
}

TEST(BiasAddGpu, BackwardIsDeterministic) {
  const int64_t rows = 6272, features = 1152;
  DeviceTensor dy = tiled_random_device_tensor({rows, features}, 70, 1.0f);
  DeviceBuffer workspace(bias_add_backward_workspace_bytes(rows, features));
  HostTensor first, second;
  for (HostTensor* out : {&first, &second}) {
    DeviceTensor db = device_tensor(DType::f32, {features});
    device_fill_bytes(db.view, 0);
    bias_add_backward_cuda(bf16_ptr(dy), f32_ptr(db), rows, features, workspace.data(), workspace.bytes(), nullptr);
    *out = to_host(db.view);
  }
  EXPECT_EQ(std::memcmp(first.data(), second.data(), first.nbytes()), 0) << "d_bias differs between two runs";
  std::printf("  d_bias 6272x1152 bit-identical over two runs: %s\n",
              std::memcmp(first.data(), second.data(), first.nbytes()) == 0 ? "yes" : "NO");
}

TEST(BiasAddGpu, BadArgumentsAreRejected) {
  DeviceTensor t = device_tensor(DType::bf16, {4, 8});
  DeviceTensor r = device_tensor(DType::f32, {8});
  EXPECT_THROW(bias_add_forward_cuda(bf16_ptr(t), bf16_ptr(t), 4, 0, nullptr), Error);
  EXPECT_THROW(bias_add_forward_cuda(bf16_ptr(t), bf16_ptr(t), -1, 8, nullptr), Error);
  EXPECT_THROW(bias_add_backward_cuda(bf16_ptr(t), f32_ptr(r), 4, 8, nullptr, 0, nullptr), Error);
}

TEST(BiasAddGpu, TimingAtVisionShapes) {
  const int64_t rows = 6272, features = 3456;  // qkv output of 8 images of 448x448
  DeviceTensor y = tiled_random_device_tensor({rows, features}, 1, 1.0f);
  DeviceTensor bias = to_device(random_normal_tensor({features}, 2, 0.1f), DType::bf16);
  DeviceTensor db = device_tensor(DType::f32, {features});
  DeviceBuffer workspace(bias_add_backward_workspace_bytes(rows, features));
  const double tensor_bytes = static_cast<double>(rows) * features * 2;
  double fwd = median_ms([&](cudaStream_t s) { bias_add_forward_cuda(bf16_ptr(bias), bf16_ptr(y), rows, features, s); },
                         nullptr);
  print_bandwidth_timing("bias_add 6272x3456 fwd (in place)", fwd, 2 * tensor_bytes);
  double bwd = median_ms([&](cudaStream_t s) {
    bias_add_backward_cuda(bf16_ptr(y), f32_ptr(db), rows, features, workspace.data(), workspace.bytes(), s);
  }, nullptr);
  print_bandwidth_timing("bias_add 6272x3456 bwd (column sums)", bwd, tensor_bytes);
}

}  // namespace
}  // namespace deltamoe
