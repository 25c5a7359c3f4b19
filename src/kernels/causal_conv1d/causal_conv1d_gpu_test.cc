// GPU test of the causal conv1d + SiLU kernels against the fp32 CPU reference on the same
// bf16-rounded inputs: packed short sequences, odd channel counts, and the Qwen3.5-35B conv width;
// y and dy in one dense [T, C] block and split into three column blocks (the GDN's q | k | v).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "kernels/causal_conv1d/causal_conv1d.h"
#include "kernels/causal_conv1d/causal_conv1d_cuda.h"
#include "kernels/gated_delta_rule/gdn_gpu_test_util.h"

namespace deltamoe {
namespace {

using namespace gdn_gpu_test;

// bf16 outputs hold ~3 significant digits: 1e-2 relative L2 leaves room for fp32 ordering noise.
constexpr double kBf16Tolerance = 1e-2;
// dweight is an fp32 sum of bf16-exact products; only the summation order differs.
constexpr double kF32Tolerance = 1e-4;

struct ConvCase {
  std::vector<int> lengths;
  int channels;
  int kernel_size;
  // Column blocks of y / dy (widths summing to channels); empty: one dense [T, C] block.
  std::vector<int64_t> split = {};
};

// Columns [begin, begin + width) of a [rows, C] f32 tensor as a dense [rows, width] one.
HostTensor columns_of(const HostTensor& t, int64_t begin, int64_t width) {
  const int64_t rows = t.shape()[0], C = t.shape()[1];
  HostTensor out(DType::f32, Shape{rows, width});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) out.as<float>()[r * width + c] = t.as<float>()[r * C + begin + c];
  return out;
}

void run_case(const ConvCase& cc, bool time_it) {
  const std::vector<int32_t> offsets = offsets_of(cc.lengths);
  const int num_seqs = static_cast<int>(cc.lengths.size());
  const int64_t tokens = offsets.back();
  const int C = cc.channels, K = cc.kernel_size;
  std::printf("case: %d sequences, T=%lld, C=%d, K=%d\n", num_seqs, static_cast<long long>(tokens),
              C, K);
  const HostTensor x = bf16_rounded(random_normal_tensor(Shape{tokens, C}, 11));
  const HostTensor w = bf16_rounded(random_normal_tensor(Shape{C, K}, 12, 0.5f));
  const HostTensor dy = bf16_rounded(random_normal_tensor(Shape{tokens, C}, 13));
  const HostTensor dw_start = random_normal_tensor(Shape{C, K}, 14);  // checks "added to"

  HostTensor y_ref(DType::f32, Shape{tokens, C}), dx_ref(DType::f32, Shape{tokens, C});
  HostTensor dw_ref = random_normal_tensor(Shape{C, K}, 14);
  causal_conv1d_forward_ref(x.as<float>(), w.as<float>(), offsets.data(), num_seqs, tokens, C, K,
                            y_ref.as<float>());
  causal_conv1d_backward_ref(x.as<float>(), w.as<float>(), dy.as<float>(), offsets.data(),
                             num_seqs, tokens, C, K, dx_ref.as<float>(), dw_ref.as<float>());

  const std::vector<int64_t> widths = cc.split.empty() ? std::vector<int64_t>{C} : cc.split;
  ASSERT_LE(widths.size(), 3u);
  DeviceTensor d_x = to_device(x, DType::bf16), d_w = to_device(w, DType::bf16);
  DeviceTensor d_cu = upload_offsets(offsets);
  // y's blocks (poisoned) and dy's blocks (the columns of dy).
  std::vector<DeviceTensor> d_y_parts, d_dy_parts;
  CausalConv1dOutput y_cols;
  CausalConv1dOutputGrad dy_cols;
  int64_t begin = 0;
  for (size_t i = 0; i < widths.size(); ++i) {
    d_y_parts.push_back(poisoned(DType::bf16, Shape{tokens, widths[i]}));
    d_dy_parts.push_back(to_device(columns_of(dy, begin, widths[i]), DType::bf16));
    y_cols.part[i] = bf16_ptr(d_y_parts.back());
    y_cols.width[i] = widths[i];
    dy_cols.part[i] = bf16_ptr(d_dy_parts.back());
    dy_cols.width[i] = widths[i];
    begin += widths[i];
  }
  DeviceTensor d_dx = poisoned(DType::bf16, Shape{tokens, C});
  DeviceTensor d_dw = to_device(dw_start, DType::f32);
  const int32_t* cu = static_cast<const int32_t*>(d_cu.view.data);
  const size_t ws_bytes = causal_conv1d_backward_workspace_bytes(tokens, C, K);
  DeviceTensor d_ws = poisoned(DType::u8, Shape{static_cast<int64_t>(ws_bytes)});
  causal_conv1d_forward_cuda(bf16_ptr(d_x), bf16_ptr(d_w), cu, num_seqs, tokens, C, K, y_cols, nullptr);
  causal_conv1d_backward_cuda(bf16_ptr(d_x), bf16_ptr(d_w), dy_cols, cu, num_seqs, tokens,
                              C, K, bf16_ptr(d_dx), f32_ptr(d_dw), d_ws.view.data, ws_bytes, nullptr);
  device_synchronize();
  begin = 0;
  for (size_t i = 0; i < widths.size(); ++i) {
    expect_close("y part " + std::to_string(i), download_f32(d_y_parts[i]), columns_of(y_ref, begin, widths[i]),
                 kBf16Tolerance);
    begin += widths[i];
  }
  expect_close("dx", download_f32(d_dx), dx_ref, kBf16Tolerance);
  expect_close("dweight (added to)", download_f32(d_dw), dw_ref, kF32Tolerance);
  // Deterministic: a rerun from the same start gives the same bits; a frozen weight (null) still
  // gives the same dx.
  DeviceTensor d_dw_again = to_device(dw_start, DType::f32);
  DeviceTensor d_dx_frozen = poisoned(DType::bf16, Shape{tokens, C});
  causal_conv1d_backward_cuda(bf16_ptr(d_x), bf16_ptr(d_w), dy_cols, cu, num_seqs, tokens, C, K,
                              bf16_ptr(d_dx), f32_ptr(d_dw_again), d_ws.view.data, ws_bytes, nullptr);
  causal_conv1d_backward_cuda(bf16_ptr(d_x), bf16_ptr(d_w), dy_cols, cu, num_seqs, tokens, C, K,
                              bf16_ptr(d_dx_frozen), nullptr, nullptr, 0, nullptr);
  device_synchronize();
  EXPECT_TRUE(device_bytes_equal(d_dw, d_dw_again)) << "dweight is not deterministic";
  EXPECT_TRUE(device_bytes_equal(d_dx, d_dx_frozen)) << "dx depends on the weight gradient";

  if (time_it) {
    // Forward moves x and y (bf16); backward reads x, dy and writes dx.
    const double fwd_bytes = 2.0 * tokens * C * 2, bwd_bytes = 3.0 * tokens * C * 2;
    const double fwd_ms = median_ms([&] {
      causal_conv1d_forward_cuda(bf16_ptr(d_x), bf16_ptr(d_w), cu, num_seqs, tokens, C, K, y_cols, nullptr);
    });
    const double bwd_ms = median_ms([&] {
      causal_conv1d_backward_cuda(bf16_ptr(d_x), bf16_ptr(d_w), dy_cols, cu, num_seqs, tokens, C, K,
                                  bf16_ptr(d_dx), f32_ptr(d_dw), d_ws.view.data, ws_bytes, nullptr);
    });
    print_bandwidth("causal_conv1d forward", fwd_ms, fwd_bytes);
    print_bandwidth("causal_conv1d backward", bwd_ms, bwd_bytes);
  }
}

TEST(CausalConv1dGpu, PackedShortSequencesOddChannels) {
  run_case({{1, 63, 64, 65, 130}, 37, 4}, false);
}

TEST(CausalConv1dGpu, SingleTokenAndEmptySequence) {
  run_case({{1}, 5, 4}, false);
  run_case({{3, 0, 2}, 9, 3}, false);
}

// Every kernel width the launchers take, sequences shorter and longer than it, strip boundaries
// (32 and 64 tokens) inside sequences, and a 16-channel layout that takes the vector path.
TEST(CausalConv1dGpu, EveryKernelWidthVectorPath) {
  for (int K = 1; K <= kCausalConv1dMaxKernel; ++K) run_case({{1, 2, 7, 100, 0, 33, 64, 3}, 16, K}, false);
}

// y and dy split into three column blocks, on the vector path (widths multiples of 8) and off it.
TEST(CausalConv1dGpu, ColumnBlocks) {
  run_case({{5, 70, 130}, 48, 4, {16, 16, 16}}, false);
  run_case({{5, 70, 130}, 43, 4, {10, 21, 12}}, false);
  run_case({{200}, 40, 3, {8, 24, 8}}, false);
}

TEST(CausalConv1dGpu, ManyShortSequences) {
  std::vector<int> lengths;
  for (int i = 0; i < 200; ++i) lengths.push_back(1 + (i * 7) % 13);
  run_case({lengths, 130, 4}, false);
}

// Qwen3.5-35B-A3B: conv_dim = 2 * 16 * 128 (q, k) + 32 * 128 (v) = 8192, 8192 tokens as 2 x 4096.
// Qwen3.5-35B-A3B: conv_dim = 2 * 16 * 128 (q, k) + 32 * 128 (v) = 8192, 8192 tokens as 2 x 4096,
// y and dy in the model's q | k | v blocks.
TEST(CausalConv1dGpu, Qwen35BShapeTimed) { run_case({{4096, 4096}, 8192, 4, {2048, 2048, 4096}}, true); }

}  // namespace
}  // namespace deltamoe
