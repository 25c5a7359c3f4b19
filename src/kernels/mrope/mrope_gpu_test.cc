// GPU test of partial interleaved M-RoPE (tables, rotation, inverse rotation, in place) against
// the reference with 3-D positions whose axes differ; timing for q and k at 8192 tokens.
#include <gtest/gtest.h>

#include "core/rng.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/mrope/mrope.h"
#include "kernels/mrope/mrope_cuda.h"

namespace deltamoe {
namespace {

HostTensor random_positions(int64_t tokens, int64_t max_position, uint64_t seed) {
  HostTensor positions(DType::i64, {3, tokens});
  Rng rng(seed);
  for (int64_t i = 0; i < 3 * tokens; ++i)
    positions.as<int64_t>()[i] = static_cast<int64_t>(rng.uniform() * static_cast<float>(max_position));
  return positions;
}

MropeSpec make_spec(int64_t rotary_dim, int64_t s0, int64_t s1, int64_t s2) {
  MropeSpec spec;
  spec.rotary_dim = rotary_dim;
  spec.section = {s0, s1, s2};
  spec.theta = 10000000.0;  // Qwen3.5's rope_theta
  return spec;
}

// Packed text sequences (cu_seqlens): positions restart at 0 in each sequence, equal on all axes.
HostTensor packed_text_positions(const std::vector<int64_t>& lengths) {
  int64_t tokens = 0;
  for (int64_t length : lengths) tokens += length;
  HostTensor positions(DType::i64, {3, tokens});
  int64_t t = 0;
  for (int64_t length : lengths)
    for (int64_t p = 0; p < length; ++p, ++t)
      for (int axis = 0; axis < 3; ++axis) positions.as<int64_t>()[axis * tokens + t] = p;
  return positions;
}

void check_mrope(const MropeSpec& spec, const HostTensor& positions, int64_t heads, int64_t head_dim,
                 uint64_t seed) {
  const int64_t tokens = positions.shape()[1];
  std::printf("mrope T=%lld H=%lld D=%lld R=%lld\n", static_cast<long long>(tokens), static_cast<long long>(heads),
              static_cast<long long>(head_dim), static_cast<long long>(spec.rotary_dim));
  const int64_t half = spec.rotary_dim / 2;
  HostTensor x = random_bf16_exact({tokens, heads, head_dim}, seed + 1);
  HostTensor dy = random_bf16_exact({tokens, heads, head_dim}, seed + 2);
  HostTensor cos_ref(DType::f32, {tokens, half}), sin_ref(DType::f32, {tokens, half});
  mrope_tables_ref(spec, positions.as<int64_t>(), tokens, cos_ref.as<float>(), sin_ref.as<float>());
  HostTensor y_ref(DType::f32, {tokens, heads, head_dim}), dx_ref(DType::f32, {tokens, heads, head_dim});
  mrope_forward_ref(spec, x.as<float>(), cos_ref.as<float>(), sin_ref.as<float>(), y_ref.as<float>(), tokens, heads,
                    head_dim);
  mrope_backward_ref(spec, dy.as<float>(), cos_ref.as<float>(), sin_ref.as<float>(), dx_ref.as<float>(), tokens,
                     heads, head_dim);

  DeviceTensor positions_d = to_device(positions);
  DeviceTensor cos_d = poisoned_device_tensor(DType::f32, {tokens, half});
  DeviceTensor sin_d = poisoned_device_tensor(DType::f32, {tokens, half});
  DeviceTensor x_d = to_device(x, DType::bf16), dy_d = to_device(dy, DType::bf16);
  DeviceTensor y_d = poisoned_device_tensor(DType::bf16, {tokens, heads, head_dim});
  mrope_tables_cuda(spec, positions_d.view.as<int64_t>(), tokens, f32_ptr(cos_d), f32_ptr(sin_d), nullptr);
  mrope_forward_cuda(spec, bf16_ptr(x_d), f32_ptr(cos_d), f32_ptr(sin_d), bf16_ptr(y_d), tokens, heads, head_dim,
                     nullptr);
  // The backward in place (dx aliases dy), as the attention backward uses it.
  mrope_backward_cuda(spec, bf16_ptr(dy_d), f32_ptr(cos_d), f32_ptr(sin_d), bf16_ptr(dy_d), tokens, heads, head_dim,
                      nullptr);
  device_synchronize();
  // Same fp32 angles; device cosf/sinf are within 2 ulp of the host's: tables to 1e-6.
  expect_close("cos table (f32)", cos_d, cos_ref, 1e-6);
  expect_close("sin table (f32)", sin_d, sin_ref, 1e-6);
  expect_close("y (bf16)", y_d, y_ref, 1e-2);
  expect_close("dx in place (bf16)", dy_d, dx_ref, 1e-2);
  // Channels past R are copies: exact.
  HostTensor y_host = to_host(y_d.view).to_f32();
  double max_copy_diff = 0;
  for (int64_t row = 0; row < tokens * heads; ++row)
    for (int64_t c = spec.rotary_dim; c < head_dim; ++c)
      max_copy_diff = std::max(max_copy_diff, static_cast<double>(std::fabs(y_host.as<float>()[row * head_dim + c] -
                                                                            x.as<float>()[row * head_dim + c])));
  EXPECT_EQ(max_copy_diff, 0.0);
}

void check_mrope(const MropeSpec& spec, int64_t tokens, int64_t heads, int64_t head_dim, uint64_t seed) {
  check_mrope(spec, random_positions(tokens, 9000, seed + 1000), heads, head_dim, seed);
}

TEST(MropeGpu, MatchesReferenceOverShapes) {
  check_mrope(make_spec(64, 11, 11, 10), 1, 16, 256, 1);    // T = 1, Qwen3.5 full attention q
  check_mrope(make_spec(64, 11, 11, 10), 300, 2, 256, 2);   // k heads
  check_mrope(make_spec(6, 1, 1, 1), 37, 3, 10, 3);         // odd head dim, tiny sections
  check_mrope(make_spec(16, 3, 3, 2), 50, 5, 16, 4);        // full rotary (R = D)
  check_mrope(make_spec(64, 32, 0, 0), 80, 4, 256, 5);      // text-only sections (t axis only)
  // Many short packed sequences, positions restarting in each.
  check_mrope(make_spec(64, 11, 11, 10), packed_text_positions({1, 5, 17, 3, 1, 40, 2, 9}), 16, 256, 6);
}

TEST(MropeGpu, BadSpecIsRejected) {
  DeviceTensor x = device_tensor(DType::bf16, {2, 1, 8});
  DeviceTensor table = device_tensor(DType::f32, {2, 4});
  EXPECT_THROW(mrope_forward_cuda(make_spec(8, 1, 1, 1), bf16_ptr(x), f32_ptr(table), f32_ptr(table), bf16_ptr(x), 2,
                                  1, 8, nullptr),
               Error);  // sections sum to 3, not 4
  EXPECT_THROW(mrope_forward_cuda(make_spec(10, 2, 2, 1), bf16_ptr(x), f32_ptr(table), f32_ptr(table), bf16_ptr(x), 2,
                                  1, 8, nullptr),
               Error);  // rotary dim beyond the head dim
}

TEST(MropeGpu, TimingAt35BShapes) {
  const int64_t tokens = 8192, head_dim = 256;
  const MropeSpec spec = make_spec(64, 11, 11, 10);
  DeviceTensor positions = to_device(random_positions(tokens, 8192, 7));
  DeviceTensor cos = device_tensor(DType::f32, {tokens, 32}), sin = device_tensor(DType::f32, {tokens, 32});
  mrope_tables_cuda(spec, positions.view.as<int64_t>(), tokens, f32_ptr(cos), f32_ptr(sin), nullptr);
  for (int64_t heads : {16, 2}) {
    DeviceTensor x = to_device(random_normal_tensor({tokens, heads, head_dim}, 8), DType::bf16);
    DeviceTensor y = device_tensor(DType::bf16, {tokens, heads, head_dim});
    double ms = median_ms([&](cudaStream_t s) {
      mrope_forward_cuda(spec, bf16_ptr(x), f32_ptr(cos), f32_ptr(sin), bf16_ptr(y), tokens, heads, head_dim, s);
    }, nullptr);
    const std::string name = "mrope fwd 8192 tokens x " + std::to_string(heads) + " heads x 256";
    print_bandwidth_timing(name.c_str(), ms, 2.0 * tokens * heads * head_dim * 2);
    // In place, as the attention layer calls it: only the 64 rotated channels of each row move.
    ms = median_ms([&](cudaStream_t s) {
      mrope_forward_cuda(spec, bf16_ptr(x), f32_ptr(cos), f32_ptr(sin), bf16_ptr(x), tokens, heads, head_dim, s);
    }, nullptr);
    print_bandwidth_timing((name + ", in place").c_str(), ms, 2.0 * tokens * heads * 64 * 2);
  }
}

}  // namespace
}  // namespace deltamoe
