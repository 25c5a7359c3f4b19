// GPU test of cuDNN's fused SDPA (cudnn_sdpa.h) against the fp32 CPU reference on the same bf16
// inputs, at the bounds of the attention GPU tests: causal GQA D = 256 over packed sequences of
// uneven lengths (not multiples of 64, a length-1 sequence), non-causal D = 72 per-image lengths
// (the vision tower), one plan serving several packings with no plan built after setup, and the
// 2 x 4096 / 1 x 8192 shapes checked against our fp32 SIMT kernels and timed beside our kernels.
// On the sm_80 kernel path (kernel_path_cuda.h) the cuDNN path is not used: one test checks that
// it is refused there and the model falls back to our kernel; the others say so and skip.
#include <cudnn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/cuda_check.h"
#include "kernels/attention/attention.h"
#include "kernels/attention/attention_cuda.h"
#include "kernels/bidirectional_attention/bidirectional_attention.h"
#include "kernels/bidirectional_attention/bidirectional_attention_cuda.h"
#include "kernels/common/kernel_path_cuda.h"
#include "kernels/cudnn_sdpa/gpu/cudnn_attention_choice.h"
#include "kernels/cudnn_sdpa/gpu/cudnn_sdpa.h"
#include "kernels/flash_attention/attention_gpu_test_util.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"

namespace deltamoe {
namespace {

// On the sm_80 kernel path (an A800, or a compute_80 build on the H200) cuDNN SDPA is never used:
// SdpaFollowsTheKernelPath checks that it is refused there; the rest need the sm_90a path.
#define SKIP_UNLESS_HOPPER()                                                                          \
  if (!sm90a_kernels_usable())                                                                       \
  GTEST_SKIP() << "the cuDNN SDPA path is used with the sm_90a kernels only; this process runs the " \
               << kernel_path().describe() << " path"

// Builds the plans, failing the test with cuDNN's reason when it refuses.
std::unique_ptr<CudnnSdpa> build_plan(const CudnnSdpaConfig& config) {
  std::string why_not;
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<CudnnSdpa> sdpa = CudnnSdpa::create(config, &why_not);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(sdpa, nullptr) << why_not;
  if (sdpa != nullptr)
    std::printf("cuDNN SDPA plans T=%lld N=%lld Hq=%lld Hkv=%lld D=%lld %s: built in %.2f s, workspace fwd %zu / "
                "bwd %zu bytes\n",
                static_cast<long long>(config.max_tokens), static_cast<long long>(config.max_segments),
                static_cast<long long>(config.num_q_heads), static_cast<long long>(config.num_kv_heads),
                static_cast<long long>(config.head_dim), config.causal ? "causal" : "non-causal", seconds,
                sdpa->forward_workspace_bytes(), sdpa->backward_workspace_bytes());
  return sdpa;
}

CudnnSdpaConfig config_for(int64_t tokens, int64_t segments, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                           bool causal) {
  CudnnSdpaConfig c;
  c.max_tokens = tokens;
  c.max_segments = segments;
  c.num_q_heads = q_heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.causal = causal;
  c.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  return c;
}

// [T, H, D] f32 rows widened to Dp columns with zeros, and back.
HostTensor pad_heads(const HostTensor& x, int64_t padded_dim) {
  const int64_t rows = x.shape()[0] * x.shape()[1], D = x.shape()[2];
  HostTensor y(DType::f32, {x.shape()[0], x.shape()[1], padded_dim});
  std::fill(y.as<float>(), y.as<float>() + y.numel(), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    std::copy(x.as<float>() + r * D, x.as<float>() + (r + 1) * D, y.as<float>() + r * padded_dim);
  return y;
}
HostTensor unpad_heads(const HostTensor& y, int64_t dim) {
  const HostTensor y32 = y.to_f32();
  const int64_t rows = y.shape()[0] * y.shape()[1], Dp = y.shape()[2];
  HostTensor x(DType::f32, {y.shape()[0], y.shape()[1], dim});
  for (int64_t r = 0; r < rows; ++r)
    std::copy(y32.as<float>() + r * Dp, y32.as<float>() + r * Dp + dim, x.as<float>() + r * dim);
  return x;
}

// Compares a device [T, H, Dp] result's first D columns with the reference (D = Dp: as is).
void expect_close_heads(const std::string& name, const DeviceTensor& got, const HostTensor& ref, double max_rel_l2) {
  const int64_t D = ref.shape()[ref.shape().rank() - 1];
  if (got.view.shape[got.view.shape.rank() - 1] == D) {
    expect_close(name, got, ref, max_rel_l2);
    return;
  }
  CompareResult result = compare_tensors(name, unpad_heads(to_host(got.view), D), ref);
  EXPECT_TRUE(result.all_finite) << name << " has non-finite values";
  EXPECT_LE(result.rel_l2, max_rel_l2) << name;
}

// One packing through an existing plan, forward and backward, against the CPU reference. The
// packing fills the plan's rows (as a training micro-batch does) with up to its sequence count.
// data_dim below the plan's head dims: the inputs have data_dim columns per head, zero-padded to the
// plan's D (q, k) and Dv (v, out, d_out; the scale stays the plan's), and the outputs' first
// data_dim columns are checked. name_longest: the calls name the longest sequence (which picks among
// the sequence plans).
void check_packing(const CudnnSdpa& sdpa, const std::vector<int>& lengths, uint64_t seed, int64_t data_dim = 0,
                   bool name_longest = false) {
  const CudnnSdpaConfig& c = sdpa.config();
  const int64_t tokens = total_length(lengths), num_seqs = static_cast<int64_t>(lengths.size());
  ASSERT_EQ(tokens, c.max_tokens);
  ASSERT_LE(num_seqs, c.max_segments);
  const int64_t Hq = c.num_q_heads, Hkv = c.num_kv_heads, Dp = c.head_dim;
  const int64_t Dvp = c.value_dim > 0 ? c.value_dim : c.head_dim, D = data_dim > 0 ? data_dim : Dp;
  ASSERT_LE(D, std::min(Dp, Dvp));
  std::printf("cuDNN SDPA %s T=%lld sequences=%lld (plan N=%lld) Hq=%lld Hkv=%lld D=%lld\n",
              c.causal ? "causal" : "non-causal", static_cast<long long>(tokens), static_cast<long long>(num_seqs),
              static_cast<long long>(c.max_segments), static_cast<long long>(Hq), static_cast<long long>(Hkv),
              static_cast<long long>(D));
  HostTensor q = random_bf16_exact({tokens, Hq, D}, seed);
  HostTensor k = random_bf16_exact({tokens, Hkv, D}, seed + 1);
  HostTensor v = random_bf16_exact({tokens, Hkv, D}, seed + 2);
  HostTensor d_out = random_bf16_exact({tokens, Hq, D}, seed + 3);
  HostTensor cu = cu_seqlens_from_lengths(lengths);

  HostTensor out_ref(DType::f32, {tokens, Hq, D}), lse_ref(DType::f32, {tokens, Hq});
  HostTensor dq_ref(DType::f32, {tokens, Hq, D}), dk_ref(DType::f32, {tokens, Hkv, D});
  HostTensor dv_ref(DType::f32, {tokens, Hkv, D});
  const AttentionDims dims{tokens, Hq, Hkv, D};
  if (c.causal) {
    attention_forward_ref(dims, q.as<float>(), k.as<float>(), v.as<float>(), cu.as<int32_t>(), num_seqs, c.scale,
                          out_ref.as<float>(), lse_ref.as<float>());
  } else {
    ASSERT_EQ(Hq, Hkv);
    bidirectional_attention_forward_ref(q.as<float>(), k.as<float>(), v.as<float>(), cu.as<int32_t>(), num_seqs,
                                        out_ref.as<float>(), lse_ref.as<float>(), tokens, Hq, D, c.scale);
  }
  // The backward gets the forward output as the GPU stores it (bf16) and the reference lse.
  HostTensor out_bf16 = round_to_bf16(out_ref);
  if (c.causal) {
    attention_backward_ref(dims, q.as<float>(), k.as<float>(), v.as<float>(), out_bf16.as<float>(),
                           lse_ref.as<float>(), d_out.as<float>(), cu.as<int32_t>(), num_seqs, c.scale,
                           dq_ref.as<float>(), dk_ref.as<float>(), dv_ref.as<float>());
  } else {
    bidirectional_attention_backward_ref(q.as<float>(), k.as<float>(), v.as<float>(), out_bf16.as<float>(),
                                         lse_ref.as<float>(), d_out.as<float>(), cu.as<int32_t>(), num_seqs,
                                         dq_ref.as<float>(), dk_ref.as<float>(), dv_ref.as<float>(), tokens, Hq, D,
                                         c.scale);
  }

  auto padded = [&](const HostTensor& x, int64_t dim) {
    return D == dim ? to_device(x, DType::bf16) : to_device(pad_heads(x, dim), DType::bf16);
  };
  DeviceTensor q_d = padded(q, Dp), k_d = padded(k, Dp), v_d = padded(v, Dvp);
  DeviceTensor d_out_d = padded(d_out, Dvp), cu_d = to_device(cu);
  DeviceBuffer workspace(std::max(sdpa.forward_workspace_bytes(), sdpa.backward_workspace_bytes()));
  const int64_t longest = name_longest ? *std::max_element(lengths.begin(), lengths.end()) : 0;

  DeviceTensor out_d = poisoned_device_tensor(DType::bf16, {tokens, Hq, Dvp});
  DeviceTensor lse_d = poisoned_device_tensor(DType::f32, {tokens, Hq});
  sdpa.forward(bf16_ptr(q_d), bf16_ptr(k_d), bf16_ptr(v_d), cu_d.view.as<int32_t>(), num_seqs, bf16_ptr(out_d),
               f32_ptr(lse_d), workspace.data(), workspace.bytes(), nullptr, longest);
  device_synchronize();
  expect_close_heads("cuDNN out (bf16)", out_d, out_ref, 1e-2);
  expect_close("cuDNN lse (f32)", lse_d, lse_ref, 1e-4);

  DeviceTensor out_in = padded(out_bf16, Dvp), lse_in = to_device(lse_ref, DType::f32);
  DeviceTensor dq_d = poisoned_device_tensor(DType::bf16, {tokens, Hq, Dp});
  DeviceTensor dk_d = poisoned_device_tensor(DType::bf16, {tokens, Hkv, Dp});
  DeviceTensor dv_d = poisoned_device_tensor(DType::bf16, {tokens, Hkv, Dvp});
  // NaN in every scratch byte (the dQ accumulator among them): the backward clears what it sums into.
  CUDA_CHECK(cudaMemset(workspace.data(), 0xFF, workspace.bytes()));
  sdpa.backward(bf16_ptr(q_d), bf16_ptr(k_d), bf16_ptr(v_d), bf16_ptr(out_in), f32_ptr(lse_in), bf16_ptr(d_out_d),
                cu_d.view.as<int32_t>(), num_seqs, bf16_ptr(dq_d), bf16_ptr(dk_d), bf16_ptr(dv_d), workspace.data(),
                workspace.bytes(), nullptr, longest);
  device_synchronize();
  // cuDNN rounds P and dS to bf16 before their products, as our tensor-core kernels do.
  expect_close_heads("cuDNN dq (bf16)", dq_d, dq_ref, 1e-2);
  expect_close_heads("cuDNN dk (bf16)", dk_d, dk_ref, 1e-2);
  expect_close_heads("cuDNN dv (bf16)", dv_d, dv_ref, 1e-2);
}

TEST(CudnnSdpaGpu, CausalGqaPackedD256) {
  SKIP_UNLESS_HOPPER();
  // Lengths off the 64-row tiles, a length-1 sequence, the Qwen3.5-35B-A3B widths.
  const std::vector<int> lengths{300, 1, 77, 129, 64};
  auto sdpa = build_plan(config_for(total_length(lengths), 5, 16, 2, 256, true));
  ASSERT_NE(sdpa, nullptr);
  check_packing(*sdpa, lengths, 10);
}

TEST(CudnnSdpaGpu, CausalOtherGroupings) {
  SKIP_UNLESS_HOPPER();
  auto mha = build_plan(config_for(150, 2, 4, 4, 256, true));  // no grouping: dK/dV straight from the GEMMs
  ASSERT_NE(mha, nullptr);
  check_packing(*mha, {149, 1}, 20);
  auto narrow = build_plan(config_for(200, 3, 6, 2, 128, true));  // ratio 3, D = 128
  ASSERT_NE(narrow, nullptr);
  check_packing(*narrow, {5, 150, 45}, 30);
}

// The vision tower's attention (non-causal, 16 heads of 72, per-image lengths). At D = 72 cuDNN's
// backward gave a wrong dQ (its packed fp32 dQ accumulator; rel. L2 1.2), so query/key head dims
// that are not multiples of 16 are refused; the tower zero-pads q and k to 80 (v and the output
// keep 72, the scale stays 1/sqrt(72)), checked here against the CPU reference at D = 72, as is
// padding all of q/k/v to 80.
CudnnSdpaConfig vision_config(int64_t tokens, int64_t images, int64_t qk_dim, int64_t v_dim) {
  CudnnSdpaConfig c = config_for(tokens, images, 16, 16, qk_dim, false);
  c.value_dim = v_dim;
  c.scale = 1.0f / std::sqrt(72.0f);
  return c;
}

TEST(CudnnSdpaGpu, NonCausalVisionD72) {
  SKIP_UNLESS_HOPPER();
  std::string why_not;
  EXPECT_EQ(CudnnSdpa::create(config_for(456, 4, 16, 16, 72, false), &why_not), nullptr);
  EXPECT_NE(why_not.find("multiple of 16"), std::string::npos) << why_not;
  const std::vector<int> lengths{100, 1, 200, 155};
  auto tower = build_plan(vision_config(total_length(lengths), 4, 80, 72));  // what the tower runs
  ASSERT_NE(tower, nullptr);
  check_packing(*tower, lengths, 90, 72);
  auto all_padded = build_plan(vision_config(total_length(lengths), 6, 80, 0));
  ASSERT_NE(all_padded, nullptr);
  check_packing(*all_padded, lengths, 91, 72);
}

// One plan pair for (T = 512, N = 8) runs packings of 1..8 sequences of any lengths: the batch
// entries past the sequence count are empty, and no plan is built after setup.
TEST(CudnnSdpaGpu, OnePlanServesEveryPacking) {
  SKIP_UNLESS_HOPPER();
  auto causal = build_plan(config_for(512, 8, 16, 2, 256, true));
  ASSERT_NE(causal, nullptr);
  const int64_t built = CudnnSdpa::plans_built();
  check_packing(*causal, {512}, 50);
  check_packing(*causal, {100, 1, 200, 211}, 60);
  check_packing(*causal, {63, 65, 1, 127, 129, 64, 62, 1}, 70);
  check_packing(*causal, {511, 1}, 80);
  EXPECT_EQ(CudnnSdpa::plans_built(), built) << "a step built a plan";
}

// With sequence_plans, a plan for 2,500 tokens also builds plans of S = 1,024 and 2,048 rows per
// sequence; calls that name their longest sequence run on the shortest that holds it, the others
// (and the longest sequences) on the full plans: all against the reference, no plan built after setup.
TEST(CudnnSdpaGpu, SequencePlansTakeShortPackings) {
  SKIP_UNLESS_HOPPER();
  // Two heads: the fp32 reference of 2,500-row frames at the tower's 16 took minutes.
  CudnnSdpaConfig config = vision_config(2500, 4, 80, 72);
  config.num_q_heads = config.num_kv_heads = 2;
  config.sequence_plans = true;
  auto tower = build_plan(config);
  ASSERT_NE(tower, nullptr);
  // The plans each call takes (cuDNN building every shorter pair is part of what is checked).
  EXPECT_EQ(tower->plan_sequence_rows(4, 1000), 1024);
  EXPECT_EQ(tower->plan_sequence_rows(3, 1024), 1024);
  EXPECT_EQ(tower->plan_sequence_rows(2, 2000), 2048);
  EXPECT_EQ(tower->plan_sequence_rows(1, 2500), 2500);
  EXPECT_EQ(tower->plan_sequence_rows(4, 0), 2500);
  const int64_t built = CudnnSdpa::plans_built();
  check_packing(*tower, {1000, 1, 999, 500}, 120, 72, true);  // S = 1,024
  check_packing(*tower, {1024, 1024, 452}, 130, 72, true);     // exactly S = 1,024
  check_packing(*tower, {2000, 500}, 140, 72, true);           // S = 2,048
  check_packing(*tower, {2500}, 150, 72, true);                // the full plans
  check_packing(*tower, {1000, 1, 999, 500}, 160, 72, false);  // longest not named: the full plans
  EXPECT_EQ(CudnnSdpa::plans_built(), built) << "a call built a plan";
  CudnnSdpaConfig bad = config;
  bad.max_sequence_tokens = 2501;
  std::string why_not;
  EXPECT_EQ(CudnnSdpa::create(bad, &why_not), nullptr) << "S above the plan's tokens";
}

// A plan for more than kCudnnNarrowSegments sequences also builds plans for that many; packings
// that fit them run there, the others through the wide plans: both against the reference.
TEST(CudnnSdpaGpu, NarrowPlansTakeFewSequences) {
  SKIP_UNLESS_HOPPER();
  auto causal = build_plan(config_for(512, kCudnnNarrowSegments + 36, 16, 2, 256, true));
  ASSERT_NE(causal, nullptr);
  const int64_t built = CudnnSdpa::plans_built();
  check_packing(*causal, {100, 1, 200, 211}, 90);  // 4 sequences: the narrow plans
  std::vector<int> many(static_cast<size_t>(kCudnnNarrowSegments + 16), 5);  // 80 sequences: the wide ones
  many.back() = 512 - 5 * static_cast<int>(many.size() - 1);
  check_packing(*causal, many, 100);
  std::vector<int> limit(static_cast<size_t>(kCudnnNarrowSegments), 8);  // exactly the narrow capacity
  check_packing(*causal, limit, 110);
  EXPECT_EQ(CudnnSdpa::plans_built(), built) << "a call built a plan";
}

// Where the sm_90a kernels may not run, create() refuses with the path in its reason, the model's
// choice falls back to our kernel and plans no cuDNN workspace; where they may, it builds plans.
TEST(CudnnSdpaGpu, SdpaFollowsTheKernelPath) {
  const KernelPath& path = kernel_path();
  std::printf("kernel path: %s (built for %s)\n", path.describe().c_str(), cuda_architectures());
  const CudnnSdpaConfig config = config_for(128, 2, 16, 2, 256, true);
  std::string why_not;
  std::unique_ptr<CudnnSdpa> sdpa = CudnnSdpa::create(config, &why_not);
  if (path.sm90a) {
    EXPECT_NE(sdpa, nullptr) << why_not;
    EXPECT_GT(cudnn_attention_workspace_reserve(config), 0u);
  } else {
    EXPECT_EQ(sdpa, nullptr);
    EXPECT_NE(why_not.find("sm_80"), std::string::npos) << why_not;
    std::printf("refused: %s\n", why_not.c_str());
    EXPECT_EQ(cudnn_attention_workspace_reserve(config), 0u);
    EXPECT_EQ(choose_cudnn_attention(config, size_t{1} << 30, "test"), nullptr);
  }
}

// The step workspace a model plans for the cuDNN path (cudnn_attention_workspace_reserve) is what
// the plans ask, whatever the number of sequences they take, and the choice then takes cuDNN; a
// need over kCudnnWorkspaceLimit plans nothing and runs our kernel. The need hardly grows with the
// sequences a plan takes (the batch arrays only): the grouped backward's per-query-head dK / dV are
// packed in the workspace; as virtual tensors, padded per sequence slot, they had taken 134,217,728
// bytes a sequence (H100, cuDNN 9.19). Text: 8,192 tokens, 16 / 2 heads of 256, and 16 / 16; vision:
// 6,272 patches, 16 heads, q/k 80 and v 72, non-causal.
TEST(CudnnSdpaGpu, WorkspaceReserveIsWhatThePlansAsk) {
  SKIP_UNLESS_HOPPER();
  std::vector<CudnnSdpaConfig> configs;
  for (int64_t segments : {1, 2, 4, 8, 16, 64}) configs.push_back(config_for(8192, segments, 16, 2, 256, true));
  // The same without grouped heads: whether the growth with the sequences is the GQA reduction's
  // per-query-head dK / dV (the tower, 16 heads of its own, does not grow).
  for (int64_t segments : {8, 64}) configs.push_back(config_for(8192, segments, 16, 16, 256, true));
  for (int64_t segments : {8, 64}) {
    CudnnSdpaConfig vision = config_for(6272, segments, 16, 16, 80, false);
    vision.value_dim = 72;
    configs.push_back(vision);
  }
  size_t first_need = 0;  // of the first configuration (one sequence)
  for (const CudnnSdpaConfig& config : configs) {
    std::string why_not;
    const std::unique_ptr<CudnnSdpa> sdpa = CudnnSdpa::create(config, &why_not);
    ASSERT_NE(sdpa, nullptr) << why_not;
    const size_t need = std::max(sdpa->forward_workspace_bytes(), sdpa->backward_workspace_bytes());
    const size_t reserve = cudnn_attention_workspace_reserve(config);
    std::printf("WORKSPACE T=%lld N=%lld D=%lld%s: fixed %zu, forward %zu, backward %zu bytes; reserve %zu\n",
                static_cast<long long>(config.max_tokens), static_cast<long long>(config.max_segments),
                static_cast<long long>(config.head_dim), config.causal ? " causal" : "",
                CudnnSdpa::fixed_workspace_bytes(config), sdpa->forward_workspace_bytes(),
                sdpa->backward_workspace_bytes(), reserve);
    EXPECT_EQ(cudnn_attention_workspace_reserve(config), reserve) << "the same configuration, asked again";
    if (first_need == 0) first_need = need;
    if (config.max_tokens == 8192 && config.num_kv_heads == 2) {
      EXPECT_LE(need, first_need + (size_t{1} << 20)) << config.max_segments << " sequences";
    }
    if (need <= kCudnnWorkspaceLimit) {
      EXPECT_EQ(reserve, need);
      EXPECT_NE(choose_cudnn_attention(config, reserve, "test"), nullptr);
    } else {
      EXPECT_EQ(reserve, 0u);
      EXPECT_EQ(choose_cudnn_attention(config, SIZE_MAX, "test"), nullptr);
    }
  }
}

// The text model's attention operands at `tokens` rows (16 / 2 heads of 256): random inputs, the
// outputs and gradients unset. For the tests that run many calls and check memory or time.
struct TextAttentionOperands {
  static constexpr int64_t kQHeads = 16, kKvHeads = 2, kHeadDim = 256;
  explicit TextAttentionOperands(int64_t tokens)
      : q(tiled_random_device_tensor({tokens, kQHeads, kHeadDim}, 1, 1.0f)),
        k(tiled_random_device_tensor({tokens, kKvHeads, kHeadDim}, 2, 1.0f)),
        v(tiled_random_device_tensor({tokens, kKvHeads, kHeadDim}, 3, 1.0f)),
        d_out(tiled_random_device_tensor({tokens, kQHeads, kHeadDim}, 4, 1.0f)),
        out(device_tensor(DType::bf16, {tokens, kQHeads, kHeadDim})),
        lse(device_tensor(DType::f32, {tokens, kQHeads})),
        dq(device_tensor(DType::bf16, {tokens, kQHeads, kHeadDim})),
        dk(device_tensor(DType::bf16, {tokens, kKvHeads, kHeadDim})),
        dv(device_tensor(DType::bf16, {tokens, kKvHeads, kHeadDim})) {}
  void forward(const CudnnSdpa& sdpa, const int32_t* cu_seqlens, int64_t n, DeviceBuffer& workspace,
               cudaStream_t stream) {
    sdpa.forward(bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), cu_seqlens, n, bf16_ptr(out), f32_ptr(lse), workspace.data(),
                 workspace.bytes(), stream);
  }
  void backward(const CudnnSdpa& sdpa, const int32_t* cu_seqlens, int64_t n, DeviceBuffer& workspace,
                cudaStream_t stream) {
    sdpa.backward(bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), bf16_ptr(out), f32_ptr(lse), bf16_ptr(d_out), cu_seqlens, n,
                  bf16_ptr(dq), bf16_ptr(dk), bf16_ptr(dv), workspace.data(), workspace.bytes(), stream);
  }
  DeviceTensor q, k, v, d_out, out, lse, dq, dk, dv;
};

// One plan over many packings of the text model's shape (8,192 rows, up to 8 sequences, 16 / 2
// heads of 256), as a training run's steps feed it: after the first packing, no forward or backward
// may change the GPU's memory in use (cudaMemGetInfo, after a synchronisation). Each change is
// printed with the call and the packing that made it. The packings vary as the benchmark's do:
// between half the rows and all of them, 1 to 8 sequences of random lengths. The suite name says
// it reads the whole device (run_gpu_tests.sh runs it alone).
TEST(CudnnSdpaExclusive, MemoryInUseHoldsOverPackings) {
  SKIP_UNLESS_HOPPER();
  constexpr int64_t kTokens = 8192, kSegments = 8;
  using T = TextAttentionOperands;
  auto sdpa = build_plan(config_for(kTokens, kSegments, T::kQHeads, T::kKvHeads, T::kHeadDim, true));
  ASSERT_NE(sdpa, nullptr);
  TextAttentionOperands x(kTokens);
  DeviceBuffer workspace(std::max(sdpa->forward_workspace_bytes(), sdpa->backward_workspace_bytes()));
  DeviceBuffer cu(sizeof(int32_t) * (kSegments + 1));
  auto free_bytes = [] {
    device_synchronize();
    size_t free = 0, total = 0;
    CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return static_cast<int64_t>(free);
  };
  uint64_t state = 12345;
  auto below = [&state](int64_t n) {  // a small LCG: the packings need only vary
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<int64_t>((state >> 33) % static_cast<uint64_t>(n));
  };
  int64_t changes = 0, before = 0;
  for (int packing = 0; packing < 64; ++packing) {
    const int64_t total = (kTokens / 2 + below(kTokens / 2 + 1)) / 8 * 8;
    const int64_t n = 1 + below(kSegments);
    std::vector<int> lengths(static_cast<size_t>(n), 16);
    for (int64_t left = total - 16 * n; left > 0;) {
      const int64_t piece = std::min<int64_t>(left, 1 + below(total));
      lengths[static_cast<size_t>(below(n))] += static_cast<int>(piece);
      left -= piece;
    }
    const std::vector<int32_t> cu_host = [&] {
      std::vector<int32_t> c{0};
      for (int length : lengths) c.push_back(c.back() + length);
      return c;
    }();
    CUDA_CHECK(cudaMemcpy(cu.data(), cu_host.data(), cu_host.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    const int32_t* cu_ptr = static_cast<const int32_t*>(cu.data());
    std::string packing_text;
    for (int length : lengths) {
      if (!packing_text.empty()) packing_text.push_back(' ');
      packing_text.append(std::to_string(length));
    }
    if (packing == 0) before = free_bytes();
    x.forward(*sdpa, cu_ptr, n, workspace, nullptr);
    const int64_t after_forward = free_bytes();
    x.backward(*sdpa, cu_ptr, n, workspace, nullptr);
    const int64_t after_backward = free_bytes();
    for (const auto& [call, before_call, after] :
         {std::tuple{"forward", before, after_forward}, std::tuple{"backward", after_forward, after_backward}}) {
      if (after == before_call) continue;
      std::printf("MEMORY packing %d (%lld rows: %s) %s: GPU memory in use %+lld bytes\n", packing,
                  static_cast<long long>(total), packing_text.c_str(), call,
                  static_cast<long long>(before_call - after));
      if (packing > 0) ++changes;
    }
    before = after_backward;
  }
  EXPECT_EQ(changes, 0) << "forward / backward calls after the first packing changed the memory in use";
}

TEST(CudnnSdpaGpu, RefusesWhatItCannotRun) {
  SKIP_UNLESS_HOPPER();
  std::string why_not;
  EXPECT_EQ(CudnnSdpa::create(config_for(64, 1, 16, 2, 260, true), &why_not), nullptr);
  EXPECT_NE(why_not.find("head dim"), std::string::npos) << why_not;
  EXPECT_EQ(CudnnSdpa::create(config_for(64, 1, 3, 2, 64, true), &why_not), nullptr);
  EXPECT_NE(why_not.find("bad sizes"), std::string::npos) << why_not;
  auto sdpa = build_plan(config_for(64, 2, 4, 2, 64, true));
  ASSERT_NE(sdpa, nullptr);
  DeviceTensor x = device_tensor(DType::bf16, {64, 4, 64});
  DeviceTensor lse = device_tensor(DType::f32, {64, 4});
  DeviceTensor cu = to_device(cu_seqlens_from_lengths({32, 16, 16}));
  DeviceBuffer workspace(sdpa->backward_workspace_bytes());
  // More sequences than the plan holds, and a workspace smaller than it needs.
  EXPECT_THROW(sdpa->forward(bf16_ptr(x), bf16_ptr(x), bf16_ptr(x), cu.view.as<int32_t>(), 3, bf16_ptr(x),
                             f32_ptr(lse), workspace.data(), workspace.bytes(), nullptr),
               Error);
  EXPECT_THROW(sdpa->forward(bf16_ptr(x), bf16_ptr(x), bf16_ptr(x), cu.view.as<int32_t>(), 2, bf16_ptr(x),
                             f32_ptr(lse), workspace.data(), 16, nullptr),
               Error);
}

// The model's shapes: checked against our fp32 SIMT kernels (the CPU reference is too slow here;
// the SIMT kernels are themselves checked against it in attention_gpu_test) and timed beside our
// dispatching kernels on the same inputs.
void time_causal(const std::vector<int>& lengths, const char* label, double cudnn_torch_total_ms) {
  constexpr int64_t kQHeads = 16, kKvHeads = 2, kHeadDim = 256;
  const int64_t tokens = total_length(lengths), num_seqs = static_cast<int64_t>(lengths.size());
  auto sdpa = build_plan(config_for(tokens, num_seqs, kQHeads, kKvHeads, kHeadDim, true));
  ASSERT_NE(sdpa, nullptr);
  const float scale = sdpa->config().scale;
  const AttentionDims dims{tokens, kQHeads, kKvHeads, kHeadDim};
  DeviceTensor q = tiled_random_device_tensor({tokens, kQHeads, kHeadDim}, 1, 1.0f);
  DeviceTensor k = tiled_random_device_tensor({tokens, kKvHeads, kHeadDim}, 2, 1.0f);
  DeviceTensor v = tiled_random_device_tensor({tokens, kKvHeads, kHeadDim}, 3, 1.0f);
  DeviceTensor d_out = tiled_random_device_tensor({tokens, kQHeads, kHeadDim}, 4, 1.0f);
  DeviceTensor cu = to_device(cu_seqlens_from_lengths(lengths));
  const int32_t* cu_ptr = cu.view.as<int32_t>();
  DeviceTensor out = device_tensor(DType::bf16, {tokens, kQHeads, kHeadDim});
  DeviceTensor lse = device_tensor(DType::f32, {tokens, kQHeads});
  DeviceTensor dq = device_tensor(DType::bf16, {tokens, kQHeads, kHeadDim});
  DeviceTensor dk = device_tensor(DType::bf16, {tokens, kKvHeads, kHeadDim});
  DeviceTensor dv = device_tensor(DType::bf16, {tokens, kKvHeads, kHeadDim});
  DeviceBuffer ours_workspace(attention_backward_workspace_bytes(dims));
  DeviceBuffer workspace(std::max(sdpa->forward_workspace_bytes(), sdpa->backward_workspace_bytes()));

  // Correctness first: the SIMT forward gives out/lse (also the backward's inputs on both sides).
  const FlashAttentionShape shape = causal_attention_shape(dims, cu_ptr, num_seqs, scale);
  flash_attention_forward_simt_cuda(shape, bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), bf16_ptr(out), f32_ptr(lse),
                                    nullptr);
  flash_attention_backward_simt_cuda(shape, bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), bf16_ptr(out), f32_ptr(lse),
                                     bf16_ptr(d_out), bf16_ptr(dq), bf16_ptr(dk), bf16_ptr(dv), ours_workspace.data(),
                                     ours_workspace.bytes(), nullptr);
  DeviceTensor out_c = poisoned_device_tensor(DType::bf16, {tokens, kQHeads, kHeadDim});
  DeviceTensor lse_c = poisoned_device_tensor(DType::f32, {tokens, kQHeads});
  DeviceTensor dq_c = poisoned_device_tensor(DType::bf16, {tokens, kQHeads, kHeadDim});
  DeviceTensor dk_c = poisoned_device_tensor(DType::bf16, {tokens, kKvHeads, kHeadDim});
  DeviceTensor dv_c = poisoned_device_tensor(DType::bf16, {tokens, kKvHeads, kHeadDim});
  sdpa->forward(bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), cu_ptr, num_seqs, bf16_ptr(out_c), f32_ptr(lse_c),
                workspace.data(), workspace.bytes(), nullptr);
  sdpa->backward(bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), bf16_ptr(out), f32_ptr(lse), bf16_ptr(d_out), cu_ptr,
                 num_seqs, bf16_ptr(dq_c), bf16_ptr(dk_c), bf16_ptr(dv_c), workspace.data(), workspace.bytes(),
                 nullptr);
  device_synchronize();
  expect_close(std::string(label) + " cuDNN out vs simt", out_c, to_host(out.view), 1e-2);
  expect_close(std::string(label) + " cuDNN lse vs simt", lse_c, to_host(lse.view), 1e-4);
  expect_close(std::string(label) + " cuDNN dq vs simt", dq_c, to_host(dq.view), 1e-2);
  expect_close(std::string(label) + " cuDNN dk vs simt", dk_c, to_host(dk.view), 1e-2);
  expect_close(std::string(label) + " cuDNN dv vs simt", dv_c, to_host(dv.view), 1e-2);

  auto ours_forward = [&](cudaStream_t stream) {
    attention_forward_cuda(dims, bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), cu_ptr, num_seqs, scale, bf16_ptr(out),
                           f32_ptr(lse), stream);
  };
  auto ours_backward = [&](cudaStream_t stream) {
    attention_backward_cuda(dims, bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), bf16_ptr(out), f32_ptr(lse),
                            bf16_ptr(d_out), cu_ptr, num_seqs, scale, bf16_ptr(dq), bf16_ptr(dk), bf16_ptr(dv),
                            ours_workspace.data(), ours_workspace.bytes(), stream);
  };
  auto cudnn_forward = [&](cudaStream_t stream) {
    sdpa->forward(bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), cu_ptr, num_seqs, bf16_ptr(out_c), f32_ptr(lse_c),
                  workspace.data(), workspace.bytes(), stream);
  };
  auto cudnn_backward = [&](cudaStream_t stream) {
    sdpa->backward(bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), bf16_ptr(out), f32_ptr(lse), bf16_ptr(d_out), cu_ptr,
                   num_seqs, bf16_ptr(dq_c), bf16_ptr(dk_c), bf16_ptr(dv_c), workspace.data(), workspace.bytes(),
                   stream);
  };
  const double flops = attention_forward_flops(lengths, kQHeads, kHeadDim, true);
  const int64_t built = CudnnSdpa::plans_built();
  std::printf("causal attention timing %s (T=%lld, Hq=16, Hkv=2, D=256), medians of CUDA-event runs\n", label,
              static_cast<long long>(tokens));
  const double ours_f = median_ms(ours_forward, nullptr, 2, 7), ours_b = median_ms(ours_backward, nullptr, 2, 7);
  const double cudnn_f = median_ms(cudnn_forward, nullptr, 2, 7), cudnn_b = median_ms(cudnn_backward, nullptr, 2, 7);
  print_flop_timing("forward, ours", ours_f, flops);
  print_flop_timing("forward, cuDNN", cudnn_f, flops);
  print_flop_timing("backward, ours (2.5x forward FLOPs)", ours_b, 2.5 * flops);
  print_flop_timing("backward, cuDNN", cudnn_b, 2.5 * flops);
  print_flop_timing("forward + backward, ours", ours_f + ours_b, 3.5 * flops);
  print_flop_timing("forward + backward, cuDNN", cudnn_f + cudnn_b, 3.5 * flops);
  std::printf("  anchor: cuDNN SDPA through PyTorch 2.11 on the H200, forward + backward %.2f ms\n",
              cudnn_torch_total_ms);
  EXPECT_EQ(CudnnSdpa::plans_built(), built) << "timing runs built a plan";

  // The model's plan holds up to 64 sequences (GpuModelOptions::max_seqs): the same inputs
  // through it, the unused entries empty. Checked, and timed to show what the padding costs.
  auto padded = build_plan(config_for(tokens, 64, kQHeads, kKvHeads, kHeadDim, true));
  ASSERT_NE(padded, nullptr);
  DeviceBuffer padded_workspace(std::max(padded->forward_workspace_bytes(), padded->backward_workspace_bytes()));
  auto padded_forward = [&](cudaStream_t stream) {
    padded->forward(bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), cu_ptr, num_seqs, bf16_ptr(out_c), f32_ptr(lse_c),
                    padded_workspace.data(), padded_workspace.bytes(), stream);
  };
  auto padded_backward = [&](cudaStream_t stream) {
    padded->backward(bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), bf16_ptr(out), f32_ptr(lse), bf16_ptr(d_out), cu_ptr,
                     num_seqs, bf16_ptr(dq_c), bf16_ptr(dk_c), bf16_ptr(dv_c), padded_workspace.data(),
                     padded_workspace.bytes(), stream);
  };
  const double padded_f = median_ms(padded_forward, nullptr, 2, 7);
  const double padded_b = median_ms(padded_backward, nullptr, 2, 7);
  print_flop_timing("forward, cuDNN plan for 64 sequences", padded_f, flops);
  print_flop_timing("backward, cuDNN plan for 64 sequences", padded_b, 2.5 * flops);
  device_synchronize();
  expect_close(std::string(label) + " cuDNN (N=64) dq vs ours", dq_c, to_host(dq.view), 1e-2);
  expect_close(std::string(label) + " cuDNN (N=64) dk vs ours", dk_c, to_host(dk.view), 1e-2);
  expect_close(std::string(label) + " cuDNN (N=64) dv vs ours", dv_c, to_host(dv.view), 1e-2);
  padded_forward(nullptr);
  device_synchronize();
  expect_close(std::string(label) + " cuDNN (N=64) out vs ours", out_c, to_host(out.view), 1e-2);
}

// The tower's shape (8 images of 448 x 448: 8 x 784 patches, 16 heads of 72): our kernel against
// cuDNN with q and k zero-padded to 80, forward and backward, CUDA-event medians, on the same
// inputs; cuDNN's outputs checked against ours.
TEST(CudnnSdpaGpu, TimingVisionShape) {
  SKIP_UNLESS_HOPPER();
  const std::vector<int> lengths(8, 784);
  const int64_t T = total_length(lengths), H = 16, N = 8, D = 72, Dqk = 80;
  const float scale = 1.0f / std::sqrt(72.0f);
  DeviceTensor cu = to_device(cu_seqlens_from_lengths(lengths));
  const int32_t* cu_ptr = cu.view.as<int32_t>();
  const double flops = attention_forward_flops(lengths, H, D, false);
  std::printf("vision attention timing (8 x 784, H=16, D=72), medians of CUDA-event runs\n");
  DeviceTensor q = tiled_random_device_tensor({T, H, D}, 1, 1.0f), k = tiled_random_device_tensor({T, H, D}, 2, 1.0f);
  DeviceTensor v = tiled_random_device_tensor({T, H, D}, 3, 1.0f), d_out = tiled_random_device_tensor({T, H, D}, 4, 1.0f);
  DeviceTensor out = device_tensor(DType::bf16, {T, H, D}), lse = device_tensor(DType::f32, {T, H});
  DeviceTensor dq = device_tensor(DType::bf16, {T, H, D}), dk = device_tensor(DType::bf16, {T, H, D});
  DeviceTensor dv = device_tensor(DType::bf16, {T, H, D});
  DeviceBuffer ours_workspace(bidirectional_attention_backward_workspace_bytes(T, H));
  auto ours_forward = [&](cudaStream_t stream) {
    bidirectional_attention_forward_cuda(bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), cu_ptr, N, bf16_ptr(out), f32_ptr(lse),
                                         T, H, D, scale, stream);
  };
  auto ours_backward = [&](cudaStream_t stream) {
    bidirectional_attention_backward_cuda(bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), bf16_ptr(out), f32_ptr(lse),
                                          bf16_ptr(d_out), cu_ptr, N, bf16_ptr(dq), bf16_ptr(dk), bf16_ptr(dv), T, H,
                                          D, scale, ours_workspace.data(), ours_workspace.bytes(), stream);
  };
  const double ours_f = median_ms(ours_forward, nullptr, 2, 7), ours_b = median_ms(ours_backward, nullptr, 2, 7);
  // q and k zero-padded per head to 80 (the tower's rotary kernel writes them so).
  auto pad = [&](const DeviceTensor& x) {
    DeviceTensor y = device_tensor(DType::bf16, {T, H, Dqk});
    device_fill_bytes(y.view, 0);
    CUDA_CHECK(cudaMemcpy2D(y.view.data, Dqk * 2, x.view.data, D * 2, D * 2, T * H, cudaMemcpyDeviceToDevice));
    return y;
  };
  DeviceTensor qp = pad(q), kp = pad(k);
  auto sdpa = build_plan(vision_config(T, N, Dqk, D));
  ASSERT_NE(sdpa, nullptr);
  DeviceBuffer workspace(std::max(sdpa->forward_workspace_bytes(), sdpa->backward_workspace_bytes()));
  DeviceTensor out_c = poisoned_device_tensor(DType::bf16, {T, H, D}), lse_c = poisoned_device_tensor(DType::f32, {T, H});
  DeviceTensor dq_c = poisoned_device_tensor(DType::bf16, {T, H, Dqk}), dk_c = poisoned_device_tensor(DType::bf16, {T, H, Dqk});
  DeviceTensor dv_c = poisoned_device_tensor(DType::bf16, {T, H, D});
  auto cudnn_forward = [&](cudaStream_t stream) {
    sdpa->forward(bf16_ptr(qp), bf16_ptr(kp), bf16_ptr(v), cu_ptr, N, bf16_ptr(out_c), f32_ptr(lse_c), workspace.data(),
                  workspace.bytes(), stream);
  };
  auto cudnn_backward = [&](cudaStream_t stream) {
    sdpa->backward(bf16_ptr(qp), bf16_ptr(kp), bf16_ptr(v), bf16_ptr(out), f32_ptr(lse), bf16_ptr(d_out), cu_ptr, N,
                   bf16_ptr(dq_c), bf16_ptr(dk_c), bf16_ptr(dv_c), workspace.data(), workspace.bytes(), stream);
  };
  const double f = median_ms(cudnn_forward, nullptr, 2, 7), b = median_ms(cudnn_backward, nullptr, 2, 7);
  // The same calls naming their longest sequence (784 rows), through the plans of S = 1,024.
  CudnnSdpaConfig by_frame = vision_config(T, N, Dqk, D);
  by_frame.sequence_plans = true;
  auto sdpa_s = build_plan(by_frame);
  ASSERT_NE(sdpa_s, nullptr);
  EXPECT_EQ(sdpa_s->plan_sequence_rows(N, 784), 1024) << "the plans of S = 1,024 were not built";
  DeviceBuffer workspace_s(std::max(sdpa_s->forward_workspace_bytes(), sdpa_s->backward_workspace_bytes()));
  const double f_s = median_ms(
      [&](cudaStream_t stream) {
        sdpa_s->forward(bf16_ptr(qp), bf16_ptr(kp), bf16_ptr(v), cu_ptr, N, bf16_ptr(out_c), f32_ptr(lse_c),
                        workspace_s.data(), workspace_s.bytes(), stream, 784);
      },
      nullptr, 2, 7);
  const double b_s = median_ms(
      [&](cudaStream_t stream) {
        sdpa_s->backward(bf16_ptr(qp), bf16_ptr(kp), bf16_ptr(v), bf16_ptr(out), f32_ptr(lse), bf16_ptr(d_out), cu_ptr,
                         N, bf16_ptr(dq_c), bf16_ptr(dk_c), bf16_ptr(dv_c), workspace_s.data(), workspace_s.bytes(),
                         stream, 784);
      },
      nullptr, 2, 7);
  print_flop_timing("vision forward, cuDNN, plans of S = 1,024", f_s, flops);
  print_flop_timing("vision backward, cuDNN, plans of S = 1,024", b_s, 2.5 * flops);
  print_flop_timing("vision forward + backward, cuDNN, plans of S = 1,024", f_s + b_s, 3.5 * flops);
  print_flop_timing("vision forward, ours", ours_f, flops);
  print_flop_timing("vision forward, cuDNN (q, k padded to 80)", f, flops);
  print_flop_timing("vision backward, ours (2.5x forward FLOPs)", ours_b, 2.5 * flops);
  print_flop_timing("vision backward, cuDNN", b, 2.5 * flops);
  print_flop_timing("vision forward + backward, ours", ours_f + ours_b, 3.5 * flops);
  print_flop_timing("vision forward + backward, cuDNN", f + b, 3.5 * flops);
  device_synchronize();
  expect_close("vision cuDNN out vs ours", out_c, to_host(out.view), 1e-2);
  expect_close("vision cuDNN lse vs ours", lse_c, to_host(lse.view), 1e-4);
  expect_close_heads("vision cuDNN dq vs ours", dq_c, to_host(dq.view), 2e-2);
  expect_close_heads("vision cuDNN dk vs ours", dk_c, to_host(dk.view), 2e-2);
  expect_close("vision cuDNN dv vs ours", dv_c, to_host(dv.view), 2e-2);
}

// What a plan's sequence capacity costs: the same packings (2 x 4,096; 8 of ~1,024) through plans
// built for 2 / 8, 64 and 1,024 sequences (`train` plans for up to max_tokens / 8 of them; each
// sequence slot is a batch entry of cuDNN's grid, empty ones included). The plan for 1,024 runs
// these packings through its narrower plans (kCudnnNarrowSegments), so it should time as the 64.
TEST(CudnnSdpaGpu, TimingByPlannedSequences) {
  SKIP_UNLESS_HOPPER();
  constexpr int64_t kTokens = 8192;
  using T = TextAttentionOperands;
  TextAttentionOperands x(kTokens);
  const std::vector<std::vector<int>> packings{{4096, 4096}, {1000, 1100, 900, 1024, 1200, 800, 1068, 1100}};
  for (const std::vector<int>& lengths : packings) {
    ASSERT_EQ(total_length(lengths), kTokens);
    const int64_t n = static_cast<int64_t>(lengths.size());
    DeviceTensor cu = to_device(cu_seqlens_from_lengths(lengths));
    const int32_t* cu_ptr = cu.view.as<int32_t>();
    const double flops = attention_forward_flops(lengths, T::kQHeads, T::kHeadDim, true);
    for (int64_t planned : {n, int64_t{64}, int64_t{1024}}) {
      auto sdpa = build_plan(config_for(kTokens, planned, T::kQHeads, T::kKvHeads, T::kHeadDim, true));
      ASSERT_NE(sdpa, nullptr);
      DeviceBuffer workspace(std::max(sdpa->forward_workspace_bytes(), sdpa->backward_workspace_bytes()));
      auto forward = [&](cudaStream_t stream) { x.forward(*sdpa, cu_ptr, n, workspace, stream); };
      auto backward = [&](cudaStream_t stream) { x.backward(*sdpa, cu_ptr, n, workspace, stream); };
      const double forward_ms = median_ms(forward, nullptr, 2, 7), backward_ms = median_ms(backward, nullptr, 2, 7);
      std::printf("PLANNED %lld sequences, packing of %lld: forward %.3f ms (%.0f TFLOP/s), backward %.3f ms (%.0f "
                  "TFLOP/s), workspace %zu bytes\n",
                  static_cast<long long>(planned), static_cast<long long>(n), forward_ms, flops / forward_ms * 1e-9,
                  backward_ms, 2.5 * flops / backward_ms * 1e-9, workspace.bytes());
    }
  }
}

TEST(CudnnSdpaGpu, Timing35BShapes) {
  SKIP_UNLESS_HOPPER();
  std::printf("cuDNN %zu loaded (built against %d)\n", cudnnGetVersion(), CUDNN_VERSION);
  time_causal({4096, 4096}, "2 x 4096", 2 * 1.35);
  time_causal({8192}, "1 x 8192", 4.26);
}

}  // namespace
}  // namespace deltamoe
