// GPU test of the cuBLASLt wrapper against the linear reference (forward, dX, dW += ...), over odd
// sizes, T = 1 and the Qwen3.5-35B-A3B widths; then timing at 8192 tokens.
#include <gtest/gtest.h>

#include <vector>

#include "core/device_buffer.h"
#include "kernels/common/tensor_compare.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/linear/linear.h"

namespace deltamoe {
namespace {

struct LinearShape {
  int64_t rows, in_features, out_features;
};

void check_linear(GemmContext& ctx, const LinearShape& s, uint64_t seed) {
  std::printf("linear T=%lld K=%lld N=%lld\n", static_cast<long long>(s.rows), static_cast<long long>(s.in_features),
              static_cast<long long>(s.out_features));
  const float w_scale = 1.0f / std::sqrt(static_cast<float>(s.in_features));
  HostTensor x = random_bf16_exact({s.rows, s.in_features}, seed);
  HostTensor w = random_bf16_exact({s.out_features, s.in_features}, seed + 1, w_scale);
  HostTensor dy = random_bf16_exact({s.rows, s.out_features}, seed + 2);
  HostTensor dw_init = random_normal_tensor({s.out_features, s.in_features}, seed + 3);

  HostTensor y_ref(DType::f32, {s.rows, s.out_features});
  linear_forward_ref(x.as<float>(), w.as<float>(), y_ref.as<float>(), s.rows, s.in_features, s.out_features);
  HostTensor dx_ref(DType::f32, {s.rows, s.in_features});
  HostTensor dw_ref = random_normal_tensor({s.out_features, s.in_features}, seed + 3);  // same as dw_init
  linear_backward_ref(x.as<float>(), w.as<float>(), dy.as<float>(), dx_ref.as<float>(), dw_ref.as<float>(), s.rows,
                      s.in_features, s.out_features);

  DeviceTensor x_d = to_device(x, DType::bf16), w_d = to_device(w, DType::bf16), dy_d = to_device(dy, DType::bf16);
  DeviceTensor y_bf16 = device_tensor(DType::bf16, {s.rows, s.out_features});
  DeviceTensor y_f32 = device_tensor(DType::f32, {s.rows, s.out_features});
  DeviceTensor dx_d = device_tensor(DType::bf16, {s.rows, s.in_features});
  DeviceTensor dw_d = to_device(dw_init, DType::f32);
  device_fill_bytes(y_bf16.view, 0xFF);
  device_fill_bytes(y_f32.view, 0xFF);
  device_fill_bytes(dx_d.view, 0xFF);

  cudaStream_t stream = nullptr;
  linear_forward_cuda(ctx, bf16_ptr(x_d), bf16_ptr(w_d), y_bf16.view.data, DType::bf16, s.rows, s.in_features,
                      s.out_features, stream);
  linear_forward_cuda(ctx, bf16_ptr(x_d), bf16_ptr(w_d), y_f32.view.data, DType::f32, s.rows, s.in_features,
                      s.out_features, stream);
  linear_backward_input_cuda(ctx, bf16_ptr(dy_d), bf16_ptr(w_d), static_cast<__nv_bfloat16*>(dx_d.view.data), s.rows,
                             s.in_features, s.out_features, stream);
  linear_backward_weight_cuda(ctx, bf16_ptr(dy_d), bf16_ptr(x_d), static_cast<float*>(dw_d.view.data), s.rows,
                              s.in_features, s.out_features, stream);
  device_synchronize();

  // bf16 outputs carry one bf16 rounding (relative 2^-9): rel_l2 <= 1e-2. fp32 outputs differ from
  // the sequential CPU sum only by fp32 summation order: rel_l2 <= 1e-4.
  CompareResult y16 = compare_tensors("y (bf16 out)", to_host(y_bf16.view), y_ref);
  CompareResult y32 = compare_tensors("y (f32 out)", to_host(y_f32.view), y_ref);
  CompareResult dx = compare_tensors("dx (bf16)", to_host(dx_d.view), dx_ref);
  CompareResult dw = compare_tensors("d_weight (f32, added to)", to_host(dw_d.view), dw_ref);
  EXPECT_TRUE(y16.all_finite && y32.all_finite && dx.all_finite && dw.all_finite);
  EXPECT_LE(y16.rel_l2, 1e-2);
  EXPECT_LE(y32.rel_l2, 1e-4);
  EXPECT_LE(dx.rel_l2, 1e-2);
  EXPECT_LE(dw.rel_l2, 1e-4);
}

TEST(GemmGpu, LinearMatchesReferenceOverShapes) {
  GemmContext ctx;
  const LinearShape shapes[] = {
      {1, 64, 48},      // T = 1
      {37, 53, 29},     // odd everything (unaligned strides)
      {5, 7, 3},        // tiny
      {200, 130, 257},  // odd output width
      {64, 2048, 8192}, // q_proj of the 35B model (query | gate)
      {48, 4096, 2048}, // o_proj
      {33, 2048, 512},  // shared expert gate/up width
  };
  uint64_t seed = 100;
  for (const LinearShape& shape : shapes) check_linear(ctx, shape, seed += 10);
}

TEST(GemmGpu, GeneralStridedProductMatchesReference) {
  // C [M, N] (row stride 70) = A^T B^T with A stored [K, M] (stride 40) and B stored [N, K] (stride 50).
  const int64_t m = 31, n = 60, k = 45, lda = 40, ldb = 50, ldc = 70;
  ASSERT_LE(m, lda);
  HostTensor a = random_bf16_exact({k, lda}, 7), b = random_bf16_exact({n, ldb}, 8);
  HostTensor c_ref(DType::f32, {m, ldc});
  HostTensor c_init = random_normal_tensor({m, ldc}, 9);
  const float alpha = 0.75f, beta = -0.5f;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < ldc; ++j) {
      float value = c_init.as<float>()[i * ldc + j];
      if (j < n) {
        float sum = 0;
        for (int64_t p = 0; p < k; ++p) sum += a.as<float>()[p * lda + i] * b.as<float>()[j * ldb + p];
        value = alpha * sum + beta * value;
      }
      c_ref.as<float>()[i * ldc + j] = value;
    }
  GemmContext ctx;
  DeviceTensor a_d = to_device(a, DType::bf16), b_d = to_device(b, DType::bf16), c_d = to_device(c_init, DType::f32);
  gemm_bf16_cuda(ctx, true, true, m, n, k, alpha, bf16_ptr(a_d), lda, bf16_ptr(b_d), ldb, beta, c_d.view.data,
                 DType::f32, ldc, nullptr);
  CompareResult c = compare_tensors("C = 0.75 A^T B^T - 0.5 C (strided)", to_host(c_d.view), c_ref);
  EXPECT_TRUE(c.all_finite);
  EXPECT_LE(c.rel_l2, 1e-4);  // padding columns j >= n must be untouched: they count in the norm too
  // The same problem again reuses the cached algorithm.
  const size_t cached = ctx.num_cached_algorithms();
  gemm_bf16_cuda(ctx, true, true, m, n, k, alpha, bf16_ptr(a_d), lda, bf16_ptr(b_d), ldb, beta, c_d.view.data,
                 DType::f32, ldc, nullptr);
  device_synchronize();
  EXPECT_EQ(ctx.num_cached_algorithms(), cached);
}

// Products that differ only in their token count (a packed micro-batch of another length) run their
// class's algorithm for the count's bucket (kGemmBucketRows: all asked when the class was first
// met), after cuBLASLt's check, without asking the heuristic again, and stay right against the
// reference.
TEST(GemmGpu, NewTokenCountsReuseTheAlgorithm) {
  GemmContext ctx;
  check_linear(ctx, {512, 2048, 1024}, 500);
  const int64_t queries = GemmContext::heuristic_queries();
  check_linear(ctx, {296, 2048, 1024}, 510);
  check_linear(ctx, {776, 2048, 1024}, 520);
  EXPECT_EQ(GemmContext::heuristic_queries(), queries) << "a new token count asked the heuristic";
  check_linear(ctx, {512, 1024, 2048}, 530);  // a product of other widths is a new problem
  EXPECT_GT(GemmContext::heuristic_queries(), queries);
}

// y = x W^T (f32 out) and dW = dy^T x (fp32, from zero) of T token rows on ctx, as host values.
std::vector<float> linear_outputs(GemmContext& ctx, int64_t rows, int64_t in_features, int64_t out_features) {
  HostTensor x = random_bf16_exact({rows, in_features}, 700);
  HostTensor w = random_bf16_exact({out_features, in_features}, 701, 0.05f);
  HostTensor dy = random_bf16_exact({rows, out_features}, 702);
  DeviceTensor x_d = to_device(x, DType::bf16), w_d = to_device(w, DType::bf16), dy_d = to_device(dy, DType::bf16);
  DeviceTensor y = device_tensor(DType::f32, {rows, out_features});
  DeviceTensor dw = to_device(
      HostTensor::from_f32(std::vector<float>(static_cast<size_t>(out_features * in_features), 0.0f),
                           {out_features, in_features}),
      DType::f32);
  linear_forward_cuda(ctx, bf16_ptr(x_d), bf16_ptr(w_d), y.view.data, DType::f32, rows, in_features, out_features,
                      nullptr);
  linear_backward_weight_cuda(ctx, bf16_ptr(dy_d), bf16_ptr(x_d), static_cast<float*>(dw.view.data), rows,
                              in_features, out_features, nullptr);
  device_synchronize();
  std::vector<float> out;
  for (const HostTensor& t : {to_host(y.view), to_host(dw.view)})
    out.insert(out.end(), t.as<float>(), t.as<float>() + t.numel());
  return out;
}

// The kernel a product runs, and so its bits, depends on the product alone: two contexts that meet
// the same token counts in opposite orders compute the same values, bit for bit (a resumed run
// meets its token counts in another order than the run that saved it). The narrow output (a LoRA
// rank) makes a long weight-gradient sum that the heuristic may split.
TEST(GemmGpu, TheAlgorithmDoesNotDependOnTheTokenCountsSeenBefore) {
  for (const LinearShape& widths : {LinearShape{0, 2048, 8}, LinearShape{0, 1024, 2048}}) {
    GemmContext small_first, large_first;
    const std::vector<float> small_a = linear_outputs(small_first, 56, widths.in_features, widths.out_features);
    const std::vector<float> large_a = linear_outputs(small_first, 6000, widths.in_features, widths.out_features);
    const std::vector<float> large_b = linear_outputs(large_first, 6000, widths.in_features, widths.out_features);
    const std::vector<float> small_b = linear_outputs(large_first, 56, widths.in_features, widths.out_features);
    EXPECT_TRUE(small_a == small_b) << "56 tokens, K " << widths.in_features << " N " << widths.out_features;
    EXPECT_TRUE(large_a == large_b) << "6000 tokens, K " << widths.in_features << " N " << widths.out_features;
  }
}

TEST(GemmGpu, BadShapesAreRejected) {
  GemmContext ctx;
  DeviceTensor a = device_tensor(DType::bf16, {16, 16});
  EXPECT_THROW(gemm_bf16_cuda(ctx, false, false, 16, 16, 16, 1.0f, bf16_ptr(a), 8, bf16_ptr(a), 16, 0.0f,
                              a.view.data, DType::bf16, 16, nullptr),
               Error);
  EXPECT_THROW(gemm_bf16_cuda(ctx, false, false, 4, 4, 4, 1.0f, bf16_ptr(a), 16, bf16_ptr(a), 16, 0.0f, a.view.data,
                              DType::i32, 16, nullptr),
               Error);
}

TEST(GemmGpu, TimingAt35BShapes) {
  GemmContext ctx;
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  const int64_t tokens = 8192;
  struct Case {
    const char* name;
    int64_t in_features, out_features;
  };
  const Case cases[] = {{"q_proj 2048->8192", 2048, 8192}, {"o_proj 4096->2048", 4096, 2048},
                        {"gdn in_proj_qkv 2048->8192", 2048, 8192}, {"shared expert 2048->1024", 2048, 1024}};
  for (const Case& c : cases) {
    DeviceTensor x = to_device(random_normal_tensor({tokens, c.in_features}, 1), DType::bf16);
    DeviceTensor w = to_device(random_normal_tensor({c.out_features, c.in_features}, 2, 0.02f), DType::bf16);
    DeviceTensor dy = to_device(random_normal_tensor({tokens, c.out_features}, 3), DType::bf16);
    DeviceTensor y = device_tensor(DType::bf16, {tokens, c.out_features});
    DeviceTensor dx = device_tensor(DType::bf16, {tokens, c.in_features});
    DeviceTensor dw = to_device(random_normal_tensor({c.out_features, c.in_features}, 4), DType::f32);
    const double flops = 2.0 * tokens * c.in_features * c.out_features;
    std::string base = c.name;
    double fwd = median_ms([&](cudaStream_t s) {
      linear_forward_cuda(ctx, bf16_ptr(x), bf16_ptr(w), y.view.data, DType::bf16, tokens, c.in_features,
                          c.out_features, s);
    }, stream);
    print_flop_timing((base + " fwd").c_str(), fwd, flops);
    double bwd_x = median_ms([&](cudaStream_t s) {
      linear_backward_input_cuda(ctx, bf16_ptr(dy), bf16_ptr(w), static_cast<__nv_bfloat16*>(dx.view.data), tokens,
                                 c.in_features, c.out_features, s);
    }, stream);
    print_flop_timing((base + " dX").c_str(), bwd_x, flops);
    double bwd_w = median_ms([&](cudaStream_t s) {
      linear_backward_weight_cuda(ctx, bf16_ptr(dy), bf16_ptr(x), static_cast<float*>(dw.view.data), tokens,
                                  c.in_features, c.out_features, s);
    }, stream);
    print_flop_timing((base + " dW+= (f32)").c_str(), bwd_w, flops);
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace deltamoe
