// GPU test of the gated RMSNorm kernels against the fp32 CPU reference on the same bf16-rounded
// inputs: odd dims, one row, and the Qwen3.5-35B GDN output (8192 tokens x 32 heads x 128) timed.
#include <gtest/gtest.h>

#include <cstdio>

#include "kernels/gated_delta_rule/gdn_gpu_test_util.h"
#include "kernels/gated_rmsnorm/gated_rmsnorm.h"
#include "kernels/gated_rmsnorm/gated_rmsnorm_cuda.h"

namespace deltamoe {
namespace {

using namespace gdn_gpu_test;

constexpr double kBf16Tolerance = 1e-2;  // bf16 outputs: ~3 significant digits
// dweight: fp32 sums over every row in a different order (many thousands of rows at 35B).
constexpr double kSumTolerance = 1e-3;
constexpr float kEps = 1e-6f;

void run_case(int64_t rows, int dim, bool time_it) {
  std::printf("case: R=%lld D=%d\n", static_cast<long long>(rows), dim);
  const HostTensor o = bf16_rounded(random_normal_tensor(Shape{rows, dim}, 41));
  const HostTensor z = bf16_rounded(random_normal_tensor(Shape{rows, dim}, 42, 2.0f));
  const HostTensor w = random_normal_tensor(Shape{dim}, 43);  // fp32: read from the master copy
  const HostTensor dy = bf16_rounded(random_normal_tensor(Shape{rows, dim}, 44));
  HostTensor y_ref(DType::f32, Shape{rows, dim});
  HostTensor do_ref(DType::f32, Shape{rows, dim}), dz_ref(DType::f32, Shape{rows, dim});
  HostTensor dw_ref = random_normal_tensor(Shape{dim}, 45);  // "added to"
  gated_rmsnorm_forward_ref(o.as<float>(), z.as<float>(), w.as<float>(), rows, dim, kEps,
                            y_ref.as<float>());
  gated_rmsnorm_backward_ref(o.as<float>(), z.as<float>(), w.as<float>(), dy.as<float>(), rows,
                             dim, kEps, do_ref.as<float>(), dz_ref.as<float>(),
                             dw_ref.as<float>());

  DeviceTensor d_o = to_device(o, DType::bf16), d_z = to_device(z, DType::bf16);
  DeviceTensor d_w = to_device(w, DType::f32), d_dy = to_device(dy, DType::bf16);
  DeviceTensor d_y = poisoned(DType::bf16, Shape{rows, dim});
  DeviceTensor d_do = poisoned(DType::bf16, Shape{rows, dim});
  DeviceTensor d_dz = poisoned(DType::bf16, Shape{rows, dim});
  DeviceTensor d_dw = to_device(random_normal_tensor(Shape{dim}, 45));
  const size_t ws_bytes = gated_rmsnorm_backward_workspace_bytes(rows, dim);
  DeviceTensor d_ws = poisoned(DType::u8, Shape{static_cast<int64_t>(ws_bytes)});
  gated_rmsnorm_forward_cuda(bf16_ptr(d_o), bf16_ptr(d_z), f32_ptr(d_w), rows, dim, kEps,
                             bf16_ptr(d_y), nullptr);
  gated_rmsnorm_backward_cuda(bf16_ptr(d_o), bf16_ptr(d_z), f32_ptr(d_w), bf16_ptr(d_dy), rows,
                              dim, kEps, bf16_ptr(d_do), bf16_ptr(d_dz), f32_ptr(d_dw), d_ws.view.data, ws_bytes,
                              nullptr);
  device_synchronize();
  expect_close("y", download_f32(d_y), y_ref, kBf16Tolerance);
  expect_close("d_o", download_f32(d_do), do_ref, kBf16Tolerance);
  expect_close("dz", download_f32(d_dz), dz_ref, kBf16Tolerance);
  expect_close("dweight (added to)", download_f32(d_dw), dw_ref, kSumTolerance);
  // Deterministic: a rerun from the same start gives the same bits; a frozen weight (null) leaves
  // d_o and dz as they were.
  DeviceTensor d_dw_again = to_device(random_normal_tensor(Shape{dim}, 45));
  DeviceTensor d_do_frozen = poisoned(DType::bf16, Shape{rows, dim});
  gated_rmsnorm_backward_cuda(bf16_ptr(d_o), bf16_ptr(d_z), f32_ptr(d_w), bf16_ptr(d_dy), rows, dim, kEps,
                              bf16_ptr(d_do), bf16_ptr(d_dz), f32_ptr(d_dw_again), d_ws.view.data, ws_bytes, nullptr);
  gated_rmsnorm_backward_cuda(bf16_ptr(d_o), bf16_ptr(d_z), f32_ptr(d_w), bf16_ptr(d_dy), rows, dim, kEps,
                              bf16_ptr(d_do_frozen), bf16_ptr(d_dz), nullptr, d_ws.view.data, ws_bytes, nullptr);
  device_synchronize();
  EXPECT_TRUE(device_bytes_equal(d_dw, d_dw_again)) << "dweight is not deterministic";
  EXPECT_TRUE(device_bytes_equal(d_do, d_do_frozen)) << "d_o depends on the weight gradient";

  if (time_it) {
    const double fwd_ms = median_ms([&] {
      gated_rmsnorm_forward_cuda(bf16_ptr(d_o), bf16_ptr(d_z), f32_ptr(d_w), rows, dim, kEps,
                                 bf16_ptr(d_y), nullptr);
    });
    const double bwd_ms = median_ms([&] {
      gated_rmsnorm_backward_cuda(bf16_ptr(d_o), bf16_ptr(d_z), f32_ptr(d_w), bf16_ptr(d_dy),
                                  rows, dim, kEps, bf16_ptr(d_do), bf16_ptr(d_dz), f32_ptr(d_dw),
                                  d_ws.view.data, ws_bytes, nullptr);
    });
    print_bandwidth("gated_rmsnorm forward", fwd_ms, 3.0 * rows * dim * 2);
    print_bandwidth("gated_rmsnorm backward", bwd_ms, 5.0 * rows * dim * 2);
  }
}

TEST(GatedRmsNormGpu, OddShapes) {
  run_case(1, 128, false);
  run_case(37, 5, false);
  run_case(65, 129, false);
  // Every lane width (2 .. 32 elements per lane), full rows (vector accesses) and partial ones.
  run_case(77, 64, false);
  run_case(300, 256, false);
  run_case(40, 512, false);
  run_case(20, 1024, false);
  run_case(50, 1000, false);
  // More rows than the grid's warps: each warp walks several rows.
  run_case(8192 * 2 + 5, 128, false);
}

// Qwen3.5-35B-A3B: 8192 tokens x 32 value heads, Dv = 128.
TEST(GatedRmsNormGpu, Qwen35BShapeTimed) { run_case(8192 * 32, 128, true); }

}  // namespace
}  // namespace deltamoe
