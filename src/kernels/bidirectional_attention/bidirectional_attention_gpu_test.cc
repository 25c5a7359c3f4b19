// GPU test of the vision tower's per-image bidirectional attention (bidirectional_attention_cuda.h)
// against the CPU reference on the same bf16 inputs: one patch, odd image sizes and head dims,
// many small images with empty segments, the real widths (16 heads, D = 72, 1024-patch images);
// timing at 8 images x 1024 patches in TFLOP/s next to the floor.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/bidirectional_attention/bidirectional_attention.h"
#include "kernels/bidirectional_attention/bidirectional_attention_cuda.h"
#include "kernels/flash_attention/attention_gpu_test_util.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"

namespace deltamoe {
namespace {

struct ImageCase {
  std::vector<int> lengths;  // patches per image
  int64_t heads, head_dim;
};

void check_case(const ImageCase& c, uint64_t seed) {
  const int64_t tokens = total_length(c.lengths), segments = static_cast<int64_t>(c.lengths.size());
  const int64_t H = c.heads, D = c.head_dim;
  std::printf("bidirectional attention T=%lld images=%lld H=%lld D=%lld\n", static_cast<long long>(tokens),
              static_cast<long long>(segments), static_cast<long long>(H), static_cast<long long>(D));
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  HostTensor q = random_bf16_exact({tokens, H, D}, seed);
  HostTensor k = random_bf16_exact({tokens, H, D}, seed + 1);
  HostTensor v = random_bf16_exact({tokens, H, D}, seed + 2);
  HostTensor d_out = random_bf16_exact({tokens, H, D}, seed + 3);
  HostTensor cu = cu_seqlens_from_lengths(c.lengths);

  HostTensor out_ref(DType::f32, {tokens, H, D}), lse_ref(DType::f32, {tokens, H});
  bidirectional_attention_forward_ref(q.as<float>(), k.as<float>(), v.as<float>(), cu.as<int32_t>(), segments,
                                      out_ref.as<float>(), lse_ref.as<float>(), tokens, H, D, scale);
  // The backward sees the forward output as the GPU stores it (bf16) and the reference lse.
  HostTensor out_bf16 = round_to_bf16(out_ref);
  HostTensor dq_ref(DType::f32, {tokens, H, D}), dk_ref(DType::f32, {tokens, H, D}), dv_ref(DType::f32, {tokens, H, D});
  bidirectional_attention_backward_ref(q.as<float>(), k.as<float>(), v.as<float>(), out_bf16.as<float>(),
                                       lse_ref.as<float>(), d_out.as<float>(), cu.as<int32_t>(), segments,
                                       dq_ref.as<float>(), dk_ref.as<float>(), dv_ref.as<float>(), tokens, H, D,
                                       scale);

  DeviceTensor q_d = to_device(q, DType::bf16), k_d = to_device(k, DType::bf16), v_d = to_device(v, DType::bf16);
  DeviceTensor d_out_d = to_device(d_out, DType::bf16), cu_d = to_device(cu);
  // The dispatching launcher, then each forward path on its own (tensor cores where supported).
  const FlashAttentionShape shape =
      bidirectional_attention_shape(cu_d.view.as<int32_t>(), segments, tokens, H, D, scale);
  for (int path = 0; path < 3; ++path) {
    if (path == 2 && !flash_attention_forward_mma_supported(shape)) continue;
    const char* names[] = {"dispatch", "simt", "mma"};
    DeviceTensor out_d = poisoned_device_tensor(DType::bf16, {tokens, H, D});
    DeviceTensor lse_d = poisoned_device_tensor(DType::f32, {tokens, H});
    if (path == 0) {
      bidirectional_attention_forward_cuda(bf16_ptr(q_d), bf16_ptr(k_d), bf16_ptr(v_d), cu_d.view.as<int32_t>(),
                                           segments, bf16_ptr(out_d), f32_ptr(lse_d), tokens, H, D, scale, nullptr);
    } else if (path == 1) {
      flash_attention_forward_simt_cuda(shape, bf16_ptr(q_d), bf16_ptr(k_d), bf16_ptr(v_d), bf16_ptr(out_d),
                                        f32_ptr(lse_d), nullptr);
    } else {
      flash_attention_forward_mma_cuda(shape, bf16_ptr(q_d), bf16_ptr(k_d), bf16_ptr(v_d), bf16_ptr(out_d),
                                       f32_ptr(lse_d), nullptr);
    }
    device_synchronize();
    expect_close(std::string("out (bf16) ") + names[path], out_d, out_ref, 1e-2);
    // lse is fp32 here and double-accumulated in the reference: summation order only (~1e-6).
    expect_close(std::string("lse (f32) ") + names[path], lse_d, lse_ref, 1e-4);
  }

  DeviceTensor out_in = to_device(out_bf16, DType::bf16), lse_in = to_device(lse_ref, DType::f32);
  DeviceBuffer workspace(std::max<size_t>(1, bidirectional_attention_backward_workspace_bytes(tokens, H)));
  for (int path = 0; path < 3; ++path) {
    if (path == 2 && !flash_attention_backward_mma_supported(shape)) continue;
    const std::string name = std::string(" (bf16) ") + (path == 0 ? "dispatch" : path == 1 ? "simt" : "mma");
    DeviceTensor dq_d = poisoned_device_tensor(DType::bf16, {tokens, H, D});
    DeviceTensor dk_d = poisoned_device_tensor(DType::bf16, {tokens, H, D});
    DeviceTensor dv_d = poisoned_device_tensor(DType::bf16, {tokens, H, D});
    if (path == 0) {
      bidirectional_attention_backward_cuda(bf16_ptr(q_d), bf16_ptr(k_d), bf16_ptr(v_d), bf16_ptr(out_in),
                                            f32_ptr(lse_in), bf16_ptr(d_out_d), cu_d.view.as<int32_t>(), segments,
                                            bf16_ptr(dq_d), bf16_ptr(dk_d), bf16_ptr(dv_d), tokens, H, D, scale,
                                            workspace.data(), workspace.bytes(), nullptr);
    } else {
      auto* launch = path == 1 ? flash_attention_backward_simt_cuda : flash_attention_backward_mma_cuda;
      launch(shape, bf16_ptr(q_d), bf16_ptr(k_d), bf16_ptr(v_d), bf16_ptr(out_in), f32_ptr(lse_in), bf16_ptr(d_out_d),
             bf16_ptr(dq_d), bf16_ptr(dk_d), bf16_ptr(dv_d), workspace.data(), workspace.bytes(), nullptr);
    }
    device_synchronize();
    // The tensor-core path rounds P and dS to bf16 before their products: ~2^-9 per term.
    expect_close("dq" + name, dq_d, dq_ref, 1e-2);
    expect_close("dk" + name, dk_d, dk_ref, 1e-2);
    expect_close("dv" + name, dv_d, dv_ref, 1e-2);
  }
}

TEST(BidirectionalAttentionGpu, SinglePatch) { check_case({{1}, 16, 72}, 1); }

TEST(BidirectionalAttentionGpu, OddSizes) {
  check_case({{37, 70, 5}, 3, 72}, 10);
  check_case({{33}, 2, 33}, 20);       // odd head dim
  check_case({{64, 1, 95}, 4, 256}, 30);  // the widest head dim
  check_case({{130, 3, 200}, 2, 128}, 31);  // tensor-core forward, segments across tiles
  check_case({{64, 0, 65}, 3, 64}, 32);
}

TEST(BidirectionalAttentionGpu, ManySmallImagesWithEmptySegments) {
  check_case({{4, 0, 16, 9, 0, 1, 36, 25, 16, 4, 4, 0}, 5, 40}, 40);
}

TEST(BidirectionalAttentionGpu, VisionTowerWidths) { check_case({{1024, 256}, 16, 72}, 50); }

TEST(BidirectionalAttentionGpu, TimingEightImagesOf1024) {
  constexpr int64_t kHeads = 16, kHeadDim = 72;
  const std::vector<int> lengths(8, 1024);
  const int64_t tokens = total_length(lengths), segments = static_cast<int64_t>(lengths.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  DeviceTensor q = tiled_random_device_tensor({tokens, kHeads, kHeadDim}, 1, 1.0f);
  DeviceTensor k = tiled_random_device_tensor({tokens, kHeads, kHeadDim}, 2, 1.0f);
  DeviceTensor v = tiled_random_device_tensor({tokens, kHeads, kHeadDim}, 3, 1.0f);
  DeviceTensor d_out = tiled_random_device_tensor({tokens, kHeads, kHeadDim}, 4, 1.0f);
  DeviceTensor cu = to_device(cu_seqlens_from_lengths(lengths));
  DeviceTensor out = device_tensor(DType::bf16, {tokens, kHeads, kHeadDim});
  DeviceTensor lse = device_tensor(DType::f32, {tokens, kHeads});
  DeviceTensor dq = device_tensor(DType::bf16, {tokens, kHeads, kHeadDim});
  DeviceTensor dk = device_tensor(DType::bf16, {tokens, kHeads, kHeadDim});
  DeviceTensor dv = device_tensor(DType::bf16, {tokens, kHeads, kHeadDim});
  DeviceBuffer workspace(bidirectional_attention_backward_workspace_bytes(tokens, kHeads));
  auto forward = [&](cudaStream_t stream) {
    bidirectional_attention_forward_cuda(bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), cu.view.as<int32_t>(), segments,
                                         bf16_ptr(out), f32_ptr(lse), tokens, kHeads, kHeadDim, scale, stream);
  };
  auto backward = [&](cudaStream_t stream) {
    bidirectional_attention_backward_cuda(bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), bf16_ptr(out), f32_ptr(lse),
                                          bf16_ptr(d_out), cu.view.as<int32_t>(), segments, bf16_ptr(dq),
                                          bf16_ptr(dk), bf16_ptr(dv), tokens, kHeads, kHeadDim, scale,
                                          workspace.data(), workspace.bytes(), stream);
  };
  const double forward_flops = attention_forward_flops(lengths, kHeads, kHeadDim, false);
  std::printf("bidirectional attention timing 8 x 1024 patches (H=16, D=72)\n");
  const double forward_ms = median_ms(forward, nullptr, 2, 5);
  print_flop_timing("forward", forward_ms, forward_flops);
  const double backward_ms = median_ms(backward, nullptr, 2, 5);
  print_flop_timing("backward (2.5x forward FLOPs)", backward_ms, 2.5 * forward_flops);
  print_flop_timing("forward + backward", forward_ms + backward_ms, 3.5 * forward_flops);
  CompareResult sanity = compare_tensors("dk finite check (vs itself)", to_host(dk.view), to_host(dk.view));
  EXPECT_TRUE(sanity.all_finite);
}

}  // namespace
}  // namespace deltamoe
