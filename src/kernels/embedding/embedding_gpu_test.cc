// GPU test of the fp32 embedding lookup and its fp32 scatter-add backward against the reference
// (repeated ids, odd widths, T = 1, the 35B width), the bad-id report, and timing at 8192 tokens.
#include <gtest/gtest.h>

#include "core/rng.h"
#include "kernels/embedding/embedding.h"
#include "kernels/embedding/embedding_cuda.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"

namespace deltamoe {
namespace {

HostTensor random_ids(int64_t count, int64_t vocab, uint64_t seed) {
  HostTensor ids(DType::i64, {count});
  Rng rng(seed);
  for (int64_t i = 0; i < count; ++i)
    ids.as<int64_t>()[i] = static_cast<int64_t>(rng.uniform() * static_cast<double>(vocab)) % vocab;
  return ids;
}

void check_embedding(int64_t tokens, int64_t vocab, int64_t hidden, uint64_t seed) {
  std::printf("embedding T=%lld V=%lld C=%lld\n", static_cast<long long>(tokens), static_cast<long long>(vocab),
              static_cast<long long>(hidden));
  HostTensor ids = random_ids(tokens, vocab, seed);
  HostTensor table = random_normal_tensor({vocab, hidden}, seed + 1);
  HostTensor d_out = random_normal_tensor({tokens, hidden}, seed + 2);
  HostTensor out_ref(DType::f32, {tokens, hidden});
  HostTensor d_table_ref = random_normal_tensor({vocab, hidden}, seed + 3);
  embedding_forward_ref(ids.as<int64_t>(), table.as<float>(), out_ref.as<float>(), tokens, vocab, hidden);
  DeviceTensor d_table = to_device(d_table_ref, DType::f32);  // the initial gradient, before the add
  embedding_backward_ref(ids.as<int64_t>(), d_out.as<float>(), d_table_ref.as<float>(), tokens, vocab, hidden);

  DeviceTensor ids_d = to_device(ids), table_d = to_device(table, DType::f32), d_out_d = to_device(d_out, DType::f32);
  DeviceTensor out_d = poisoned_device_tensor(DType::f32, {tokens, hidden});
  HostTensor zero_flag(DType::i32, {1});
  DeviceTensor flag_d = to_device(zero_flag);
  embedding_forward_cuda(ids_d.view.as<int64_t>(), f32_ptr(table_d), f32_ptr(out_d), tokens, vocab, hidden,
                         flag_d.view.as<int32_t>(), nullptr);
  embedding_backward_cuda(ids_d.view.as<int64_t>(), f32_ptr(d_out_d), f32_ptr(d_table), tokens, vocab, hidden,
                          nullptr);
  device_synchronize();
  // A lookup is a copy: bit-exact.
  CompareResult out = compare_tensors("out (f32 rows, exact)", to_host(out_d.view), out_ref);
  EXPECT_TRUE(out.all_finite);
  EXPECT_EQ(out.max_abs_diff, 0.0);
  expect_close("d_table (f32, added to)", d_table, d_table_ref, 1e-6);  // fp32 adds in another order only
  EXPECT_EQ(to_host(flag_d.view).as<int32_t>()[0], 0) << "no id is out of range";
}

TEST(EmbeddingGpu, MatchesReferenceOverShapes) {
  check_embedding(1, 10, 2048, 1);      // T = 1
  check_embedding(200, 7, 33, 2);       // many repeats, odd width (scalar path)
  check_embedding(513, 1000, 2048, 3);  // 35B hidden width
  check_embedding(64, 3, 8, 4);         // tiny width, heavy collisions
}

TEST(EmbeddingGpu, OutOfRangeIdIsReportedAndGivesZeroRow) {
  const int64_t vocab = 5, hidden = 16;
  HostTensor ids(DType::i64, {4});
  int64_t values[] = {1, 4, 5, -1};
  for (int i = 0; i < 4; ++i) ids.as<int64_t>()[i] = values[i];
  DeviceTensor ids_d = to_device(ids), table_d = to_device(random_normal_tensor({vocab, hidden}, 9), DType::f32);
  DeviceTensor out_d = poisoned_device_tensor(DType::f32, {4, hidden});
  HostTensor zero_flag(DType::i32, {1});
  DeviceTensor flag_d = to_device(zero_flag);
  embedding_forward_cuda(ids_d.view.as<int64_t>(), f32_ptr(table_d), f32_ptr(out_d), 4, vocab, hidden,
                         flag_d.view.as<int32_t>(), nullptr);
  const int32_t position = to_host(flag_d.view).as<int32_t>()[0];
  EXPECT_TRUE(position == 3 || position == 4) << "1 + position of a bad id, got " << position;
  HostTensor out = to_host(out_d.view).to_f32();
  for (int64_t c = 0; c < hidden; ++c) {
    EXPECT_EQ(out.as<float>()[2 * hidden + c], 0.0f);
    EXPECT_EQ(out.as<float>()[3 * hidden + c], 0.0f);
  }
}

TEST(EmbeddingGpu, TimingAt35BShapes) {
  const int64_t tokens = 8192, vocab = 248320, hidden = 2048;
  DeviceTensor ids = to_device(random_ids(tokens, vocab, 5));
  DeviceTensor table = device_tensor(DType::f32, {vocab, hidden});  // values do not matter for timing
  device_fill_bytes(table.view, 0);
  DeviceTensor out = device_tensor(DType::f32, {tokens, hidden});
  DeviceTensor d_out = to_device(random_normal_tensor({tokens, hidden}, 6), DType::f32);
  DeviceTensor d_table = device_tensor(DType::f32, {vocab, hidden});
  device_fill_bytes(d_table.view, 0);
  const double row_bytes = static_cast<double>(tokens) * hidden;
  double fwd = median_ms([&](cudaStream_t s) {
    embedding_forward_cuda(ids.view.as<int64_t>(), f32_ptr(table), f32_ptr(out), tokens, vocab, hidden, nullptr, s);
  }, nullptr);
  print_bandwidth_timing("embedding fwd 8192x2048 (f32)", fwd, row_bytes * 8);
  double bwd = median_ms([&](cudaStream_t s) {
    embedding_backward_cuda(ids.view.as<int64_t>(), f32_ptr(d_out), f32_ptr(d_table), tokens, vocab, hidden, s);
  }, nullptr);
  print_bandwidth_timing("embedding bwd (f32 atomics) 8192x2048", bwd, row_bytes * (4 + 8));
}

}  // namespace
}  // namespace deltamoe
