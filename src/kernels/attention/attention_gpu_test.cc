// GPU test of causal GQA attention over packed sequences (attention_cuda.h) against the fp32 CPU
// reference on the same bf16 inputs: T = 1, odd lengths and head dims, many short and empty
// sequences, the Qwen3.5-35B-A3B widths (16 q / 2 kv heads, D = 256), each path (dispatch, SIMT,
// mma for D <= 128, wide for D in (128, 256]); rejected bad sizes; and timing at 8192 tokens (2 x 4096
// and 1 x 8192) of the dispatch in TFLOP/s next to the floor and cuDNN, its results checked against
// the SIMT kernels.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "core/rng.h"
#include "kernels/attention/attention.h"
#include "kernels/attention/attention_cuda.h"
#include "kernels/flash_attention/attention_gpu_test_util.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"

namespace deltamoe {
namespace {

struct CausalCase {
  std::vector<int> lengths;
  int64_t q_heads, kv_heads, head_dim;
};

void check_case(const CausalCase& c, uint64_t seed) {
  const int64_t tokens = total_length(c.lengths), num_seqs = static_cast<int64_t>(c.lengths.size());
  const int64_t Hq = c.q_heads, Hkv = c.kv_heads, D = c.head_dim;
  std::printf("causal attention T=%lld sequences=%lld Hq=%lld Hkv=%lld D=%lld\n", static_cast<long long>(tokens),
              static_cast<long long>(num_seqs), static_cast<long long>(Hq), static_cast<long long>(Hkv),
              static_cast<long long>(D));
  const AttentionDims dims{tokens, Hq, Hkv, D};
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  HostTensor q = random_bf16_exact({tokens, Hq, D}, seed);
  HostTensor k = random_bf16_exact({tokens, Hkv, D}, seed + 1);
  HostTensor v = random_bf16_exact({tokens, Hkv, D}, seed + 2);
  HostTensor d_out = random_bf16_exact({tokens, Hq, D}, seed + 3);
  HostTensor cu = cu_seqlens_from_lengths(c.lengths);

  HostTensor out_ref(DType::f32, {tokens, Hq, D}), lse_ref(DType::f32, {tokens, Hq});
  attention_forward_ref(dims, q.as<float>(), k.as<float>(), v.as<float>(), cu.as<int32_t>(), num_seqs, scale,
                        out_ref.as<float>(), lse_ref.as<float>());
  // The backward gets the forward output as the GPU stores it (bf16) and the reference lse, on
  // both sides, so this check does not depend on the forward's rounding.
  HostTensor out_bf16 = round_to_bf16(out_ref);
  HostTensor dq_ref(DType::f32, {tokens, Hq, D}), dk_ref(DType::f32, {tokens, Hkv, D});
  HostTensor dv_ref(DType::f32, {tokens, Hkv, D});
  attention_backward_ref(dims, q.as<float>(), k.as<float>(), v.as<float>(), out_bf16.as<float>(), lse_ref.as<float>(),
                         d_out.as<float>(), cu.as<int32_t>(), num_seqs, scale, dq_ref.as<float>(), dk_ref.as<float>(),
                         dv_ref.as<float>());

  DeviceTensor q_d = to_device(q, DType::bf16), k_d = to_device(k, DType::bf16), v_d = to_device(v, DType::bf16);
  DeviceTensor d_out_d = to_device(d_out, DType::bf16), cu_d = to_device(cu);
  // The dispatching launcher, then each forward path on its own (tensor cores where supported;
  // "wide" = the pipelined kernels for D in (128, 256]).
  const FlashAttentionShape shape = causal_attention_shape(dims, cu_d.view.as<int32_t>(), num_seqs, scale);
  for (int path = 0; path < 4; ++path) {
    if (path == 2 && !flash_attention_forward_mma_supported(shape)) continue;
    if (path == 3 && !flash_attention_wide_supported(shape)) continue;
    const char* names[] = {"dispatch", "simt", "mma", "wide"};
    DeviceTensor out_d = poisoned_device_tensor(DType::bf16, {tokens, Hq, D});
    DeviceTensor lse_d = poisoned_device_tensor(DType::f32, {tokens, Hq});
    if (path == 0) {
      attention_forward_cuda(dims, bf16_ptr(q_d), bf16_ptr(k_d), bf16_ptr(v_d), cu_d.view.as<int32_t>(), num_seqs,
                             scale, bf16_ptr(out_d), f32_ptr(lse_d), nullptr);
    } else if (path == 1) {
      flash_attention_forward_simt_cuda(shape, bf16_ptr(q_d), bf16_ptr(k_d), bf16_ptr(v_d), bf16_ptr(out_d),
                                        f32_ptr(lse_d), nullptr);
    } else if (path == 2) {
      flash_attention_forward_mma_cuda(shape, bf16_ptr(q_d), bf16_ptr(k_d), bf16_ptr(v_d), bf16_ptr(out_d),
                                       f32_ptr(lse_d), nullptr);
    } else {
      flash_attention_forward_wide_cuda(shape, bf16_ptr(q_d), bf16_ptr(k_d), bf16_ptr(v_d), bf16_ptr(out_d),
                                        f32_ptr(lse_d), nullptr);
    }
    device_synchronize();
    expect_close(std::string("out (bf16) ") + names[path], out_d, out_ref, 1e-2);
    // lse is fp32 on both sides; only the summation order differs (~1e-6 relative; the tensor-core
    // path multiplies bf16 inputs exactly and adds in fp32 too).
    expect_close(std::string("lse (f32) ") + names[path], lse_d, lse_ref, 1e-4);
  }

  DeviceTensor out_in = to_device(out_bf16, DType::bf16), lse_in = to_device(lse_ref, DType::f32);
  DeviceBuffer workspace(std::max<size_t>(1, attention_backward_workspace_bytes(dims)));
  for (int path = 0; path < 4; ++path) {
    if (path == 2 && !flash_attention_backward_mma_supported(shape)) continue;
    if (path == 3 && !flash_attention_wide_supported(shape)) continue;
    const char* names[] = {"dispatch", "simt", "mma", "wide"};
    const std::string name = std::string(" (bf16) ") + names[path];
    DeviceTensor dq_d = poisoned_device_tensor(DType::bf16, {tokens, Hq, D});
    DeviceTensor dk_d = poisoned_device_tensor(DType::bf16, {tokens, Hkv, D});
    DeviceTensor dv_d = poisoned_device_tensor(DType::bf16, {tokens, Hkv, D});
    if (path == 0) {
      attention_backward_cuda(dims, bf16_ptr(q_d), bf16_ptr(k_d), bf16_ptr(v_d), bf16_ptr(out_in), f32_ptr(lse_in),
                              bf16_ptr(d_out_d), cu_d.view.as<int32_t>(), num_seqs, scale, bf16_ptr(dq_d),
                              bf16_ptr(dk_d), bf16_ptr(dv_d), workspace.data(), workspace.bytes(), nullptr);
    } else {
      auto* launch = path == 1   ? flash_attention_backward_simt_cuda
                     : path == 2 ? flash_attention_backward_mma_cuda
                                 : flash_attention_backward_wide_cuda;
      launch(shape, bf16_ptr(q_d), bf16_ptr(k_d), bf16_ptr(v_d), bf16_ptr(out_in), f32_ptr(lse_in), bf16_ptr(d_out_d),
             bf16_ptr(dq_d), bf16_ptr(dk_d), bf16_ptr(dv_d), workspace.data(), workspace.bytes(), nullptr);
    }
    device_synchronize();
    // The tensor-core path rounds P and dS to bf16 before their products (as FlashAttention
    // does): ~2^-9 relative per term, averaging out over the sums, still far under 1e-2.
    expect_close("dq" + name, dq_d, dq_ref, 1e-2);
    expect_close("dk" + name, dk_d, dk_ref, 1e-2);
    expect_close("dv" + name, dv_d, dv_ref, 1e-2);
  }
}

// Lengths in [0, max_length], about one in eight empty (empty sequences must be skipped).
std::vector<int> random_lengths(int count, int max_length, uint64_t seed) {
  Rng rng(seed);
  std::vector<int> lengths(count);
  for (int& length : lengths) {
    length = rng.uniform() < 0.125f ? 0 : 1 + static_cast<int>(rng.uniform() * static_cast<float>(max_length));
    length = std::min(length, max_length);
  }
  return lengths;
}

TEST(AttentionGpu, SingleToken) { check_case({{1}, 16, 2, 256}, 1); }

TEST(AttentionGpu, OddLengthsAndHeadDims) {
  check_case({{37, 1, 70}, 4, 2, 72}, 10);
  check_case({{33}, 3, 1, 33}, 20);         // odd head dim, 3 query heads on one KV head
  check_case({{100, 31}, 2, 2, 128}, 30);   // no grouping, tiles crossing a sequence boundary
  check_case({{65, 2, 19}, 6, 3, 200}, 40); // D between the kernel's head-dim classes
}

TEST(AttentionGpu, ManyShortPackedSequences) {
  check_case({random_lengths(60, 9, 5), 8, 1, 64}, 50);
  check_case({{0, 3, 0, 0, 5, 1, 1, 0}, 4, 2, 16}, 60);  // leading, repeated and trailing empties
}

TEST(AttentionGpu, Qwen35MoeWidths) { check_case({{300, 211}, 16, 2, 256}, 70); }

// The wide kernels (D in (128, 256]): tiles and K/V pairs that end mid-tile, the dK/dV pass's
// paired key tiles with an odd tile count, GQA ratios 1, 3 and 8, many short packed sequences in
// one tile, a head dim below the padded 256, and T = 1 handled above.
TEST(AttentionGpu, WidePathSweeps) {
  check_case({{129, 1, 70}, 8, 1, 256}, 80);               // ratio 8, 4 query / key tiles, ends mid-tile
  check_case({{97}, 3, 3, 256}, 90);                        // no grouping, 2 key tiles
  check_case({{5, 150}, 6, 2, 256}, 100);                   // ratio 3, odd key-tile count (3)
  check_case({random_lengths(40, 13, 7), 4, 1, 256}, 110);  // many short sequences per tile
  check_case({{77, 64, 1}, 4, 2, 136}, 120);                // D = 136 zero-padded to 256
  check_case({{0, 1, 0}, 16, 2, 256}, 130);                 // T = 1 between empty sequences
}

TEST(AttentionGpu, RejectsBadSizes) {
  HostTensor cu = cu_seqlens_from_lengths({4});
  DeviceTensor cu_d = to_device(cu);
  DeviceTensor x = device_tensor(DType::bf16, {4, 4, 512});
  DeviceTensor lse = device_tensor(DType::f32, {4, 4});
  const int32_t* cu_ptr = cu_d.view.as<int32_t>();
  // 3 query heads on 2 KV heads, and a head dim over the supported 256.
  EXPECT_THROW(attention_forward_cuda({4, 3, 2, 64}, bf16_ptr(x), bf16_ptr(x), bf16_ptr(x), cu_ptr, 1, 0.125f,
                                      bf16_ptr(x), f32_ptr(lse), nullptr),
               Error);
  EXPECT_THROW(attention_forward_cuda({4, 4, 2, 512}, bf16_ptr(x), bf16_ptr(x), bf16_ptr(x), cu_ptr, 1, 0.125f,
                                      bf16_ptr(x), f32_ptr(lse), nullptr),
               Error);
  EXPECT_THROW(attention_forward_cuda({4, 4, 2, 64}, bf16_ptr(x), bf16_ptr(x), bf16_ptr(x), cu_ptr, 0, 0.125f,
                                      bf16_ptr(x), f32_ptr(lse), nullptr),
               Error);
  // A workspace smaller than attention_backward_workspace_bytes says so.
  const AttentionDims dims{4, 4, 2, 64};
  DeviceBuffer small(4);
  EXPECT_THROW(attention_backward_cuda(dims, bf16_ptr(x), bf16_ptr(x), bf16_ptr(x), bf16_ptr(x), f32_ptr(lse),
                                       bf16_ptr(x), cu_ptr, 1, 0.125f, bf16_ptr(x), bf16_ptr(x), bf16_ptr(x),
                                       small.data(), small.bytes(), nullptr),
               Error);
}

void time_causal(const std::vector<int>& lengths, const char* label, double cudnn_forward_ms,
                 double cudnn_total_ms) {
  constexpr int64_t kQHeads = 16, kKvHeads = 2, kHeadDim = 256;
  const int64_t tokens = total_length(lengths), num_seqs = static_cast<int64_t>(lengths.size());
  const AttentionDims dims{tokens, kQHeads, kKvHeads, kHeadDim};
  const float scale = 1.0f / 16.0f;
  DeviceTensor q = tiled_random_device_tensor({tokens, kQHeads, kHeadDim}, 1, 1.0f);
  DeviceTensor k = tiled_random_device_tensor({tokens, kKvHeads, kHeadDim}, 2, 1.0f);
  DeviceTensor v = tiled_random_device_tensor({tokens, kKvHeads, kHeadDim}, 3, 1.0f);
  DeviceTensor d_out = tiled_random_device_tensor({tokens, kQHeads, kHeadDim}, 4, 1.0f);
  DeviceTensor cu = to_device(cu_seqlens_from_lengths(lengths));
  DeviceTensor out = device_tensor(DType::bf16, {tokens, kQHeads, kHeadDim});
  DeviceTensor lse = device_tensor(DType::f32, {tokens, kQHeads});
  DeviceTensor dq = device_tensor(DType::bf16, {tokens, kQHeads, kHeadDim});
  DeviceTensor dk = device_tensor(DType::bf16, {tokens, kKvHeads, kHeadDim});
  DeviceTensor dv = device_tensor(DType::bf16, {tokens, kKvHeads, kHeadDim});
  DeviceBuffer workspace(attention_backward_workspace_bytes(dims));
  auto forward = [&](cudaStream_t stream) {
    attention_forward_cuda(dims, bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), cu.view.as<int32_t>(), num_seqs, scale,
                           bf16_ptr(out), f32_ptr(lse), stream);
  };
  auto backward = [&](cudaStream_t stream) {
    attention_backward_cuda(dims, bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), bf16_ptr(out), f32_ptr(lse),
                            bf16_ptr(d_out), cu.view.as<int32_t>(), num_seqs, scale, bf16_ptr(dq), bf16_ptr(dk),
                            bf16_ptr(dv), workspace.data(), workspace.bytes(), stream);
  };
  const double forward_flops = attention_forward_flops(lengths, kQHeads, kHeadDim, true);
  const FlashAttentionShape shape = causal_attention_shape(dims, cu.view.as<int32_t>(), num_seqs, scale);
  auto forward_simt = [&](cudaStream_t stream) {
    flash_attention_forward_simt_cuda(shape, bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), bf16_ptr(out), f32_ptr(lse),
                                      stream);
  };
  auto backward_simt = [&](cudaStream_t stream) {
    flash_attention_backward_simt_cuda(shape, bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), bf16_ptr(out), f32_ptr(lse),
                                       bf16_ptr(d_out), bf16_ptr(dq), bf16_ptr(dk), bf16_ptr(dv), workspace.data(),
                                       workspace.bytes(), stream);
  };
  std::printf("causal attention timing %s (T=%lld, Hq=16, Hkv=2, D=256)\n", label, static_cast<long long>(tokens));
  const double forward_ms = median_ms(forward, nullptr, 2, 5);
  print_flop_timing("forward (dispatch)", forward_ms, forward_flops);
  const double backward_ms = median_ms(backward, nullptr, 2, 5);
  print_flop_timing("backward (dispatch; 2.5x forward FLOPs)", backward_ms, 2.5 * forward_flops);
  print_flop_timing("forward + backward (dispatch)", forward_ms + backward_ms, 3.5 * forward_flops);
  if (cudnn_forward_ms > 0)
    std::printf("  baseline cuDNN SDPA (PyTorch 2.11 on the H200): forward %.2f ms, forward + backward %.2f ms\n",
                cudnn_forward_ms, cudnn_total_ms);
  // At this size the CPU reference is too slow; instead the dispatch's results (fresh runs into
  // poisoned buffers) must match the fp32 SIMT kernels, themselves checked against the CPU
  // reference above. The tensor-core path rounds P and dS to bf16: ~1e-3 expected.
  DeviceTensor out_new = poisoned_device_tensor(DType::bf16, {tokens, kQHeads, kHeadDim});
  DeviceTensor lse_new = poisoned_device_tensor(DType::f32, {tokens, kQHeads});
  attention_forward_cuda(dims, bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), cu.view.as<int32_t>(), num_seqs, scale,
                         bf16_ptr(out_new), f32_ptr(lse_new), nullptr);
  forward_simt(nullptr);  // out and lse from the SIMT kernel: the reference, and the backward's input
  DeviceTensor dq_new = poisoned_device_tensor(DType::bf16, {tokens, kQHeads, kHeadDim});
  DeviceTensor dk_new = poisoned_device_tensor(DType::bf16, {tokens, kKvHeads, kHeadDim});
  DeviceTensor dv_new = poisoned_device_tensor(DType::bf16, {tokens, kKvHeads, kHeadDim});
  attention_backward_cuda(dims, bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), bf16_ptr(out), f32_ptr(lse), bf16_ptr(d_out),
                          cu.view.as<int32_t>(), num_seqs, scale, bf16_ptr(dq_new), bf16_ptr(dk_new),
                          bf16_ptr(dv_new), workspace.data(), workspace.bytes(), nullptr);
  backward_simt(nullptr);
  device_synchronize();
  expect_close("35B out, dispatch vs simt", out_new, to_host(out.view), 1e-2);
  expect_close("35B lse, dispatch vs simt", lse_new, to_host(lse.view), 1e-4);
  expect_close("35B dq, dispatch vs simt", dq_new, to_host(dq.view), 1e-2);
  expect_close("35B dk, dispatch vs simt", dk_new, to_host(dk.view), 1e-2);
  expect_close("35B dv, dispatch vs simt", dv_new, to_host(dv.view), 1e-2);
}

TEST(AttentionGpu, Timing35BShapes) {
  time_causal({4096, 4096}, "2 x 4096", 2 * 0.29, 2 * 1.35);
  time_causal({8192}, "1 x 8192", 0.90, 4.26);
}

}  // namespace
}  // namespace deltamoe
