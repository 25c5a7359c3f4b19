// GPU test of the l2norm kernels against the fp32 CPU reference on the same bf16-rounded inputs:
// odd dims, one row, and q plus k of Qwen3.5-35B (8192 tokens x 16 heads x 128, twice) timed.
#include <gtest/gtest.h>

#include <cstdio>

#include "kernels/gated_delta_rule/gdn_gpu_test_util.h"
#include "kernels/l2norm/l2norm.h"
#include "kernels/l2norm/l2norm_cuda.h"

namespace deltamoe {
namespace {

using namespace gdn_gpu_test;

// bf16 outputs: ~3 significant digits, so 1e-2 relative L2.
constexpr double kBf16Tolerance = 1e-2;

void run_case(int64_t rows, int dim, bool time_it) {
  std::printf("case: R=%lld D=%d\n", static_cast<long long>(rows), dim);
  const HostTensor x = bf16_rounded(random_normal_tensor(Shape{rows, dim}, 21));
  const HostTensor dy = bf16_rounded(random_normal_tensor(Shape{rows, dim}, 22));
  HostTensor y_ref(DType::f32, Shape{rows, dim}), dx_ref(DType::f32, Shape{rows, dim});
  l2norm_forward_ref(x.as<float>(), rows, dim, y_ref.as<float>());
  l2norm_backward_ref(x.as<float>(), dy.as<float>(), rows, dim, dx_ref.as<float>());

  DeviceTensor d_x = to_device(x, DType::bf16), d_dy = to_device(dy, DType::bf16);
  DeviceTensor d_y = poisoned(DType::bf16, Shape{rows, dim});
  DeviceTensor d_dx = poisoned(DType::bf16, Shape{rows, dim});
  l2norm_forward_cuda(bf16_ptr(d_x), rows, dim, bf16_ptr(d_y), nullptr);
  l2norm_backward_cuda(bf16_ptr(d_x), bf16_ptr(d_dy), rows, dim, bf16_ptr(d_dx), nullptr);
  device_synchronize();
  expect_close("y", download_f32(d_y), y_ref, kBf16Tolerance);
  expect_close("dx", download_f32(d_dx), dx_ref, kBf16Tolerance);

  if (time_it) {
    const double fwd_ms = median_ms(
        [&] { l2norm_forward_cuda(bf16_ptr(d_x), rows, dim, bf16_ptr(d_y), nullptr); });
    const double bwd_ms = median_ms([&] {
      l2norm_backward_cuda(bf16_ptr(d_x), bf16_ptr(d_dy), rows, dim, bf16_ptr(d_dx), nullptr);
    });
    print_bandwidth("l2norm forward (q and k)", fwd_ms, 2.0 * rows * dim * 2);
    print_bandwidth("l2norm backward (q and k)", bwd_ms, 3.0 * rows * dim * 2);
  }
}

TEST(L2NormGpu, OddShapes) {
  run_case(1, 128, false);
  run_case(37, 5, false);
  run_case(65, 129, false);
  run_case(3, 300, false);
  // Every lane width (1 .. 32 elements per lane), full rows (vector accesses) and partial ones, and
  // more rows than the grid's warps (each warp walks several rows).
  run_case(50, 32, false);
  run_case(77, 64, false);
  run_case(40, 256, false);
  run_case(20, 1024, false);
  run_case(9, 1000, false);
  run_case(16384 + 7, 128, false);
}

// q and k of Qwen3.5-35B-A3B at 8192 tokens: 2 x 8192 x 16 rows of 128.
TEST(L2NormGpu, Qwen35BShapeTimed) { run_case(2 * 8192 * 16, 128, true); }

}  // namespace
}  // namespace deltamoe
