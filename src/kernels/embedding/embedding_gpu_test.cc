// GPU test of the fp32 embedding lookup and its backward against the reference (repeated ids, odd
// widths, T = 1, the 35B width), the backward's determinism (bitwise equal on a rerun), the bad-id
// report, and timing at 8192 tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "core/rng.h"
#include "kernels/embedding/embedding.h"
#include "kernels/embedding/embedding_cuda.h"
#include "kernels/embedding/embedding_grad_plan.h"
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

// The plan of embedding_grad_plan on the device.
struct DeviceGradPlan {
  DeviceTensor sorted_tokens, segment_offsets, segment_ids;
  int64_t num_segments = 0;
};

template <typename T>
DeviceTensor vector_to_device(const std::vector<T>& values, DType dtype) {
  HostTensor host(dtype, {std::max<int64_t>(static_cast<int64_t>(values.size()), 1)});
  std::memcpy(host.data(), values.data(), values.size() * sizeof(T));
  return to_device(host);
}

DeviceGradPlan device_grad_plan(const HostTensor& ids, int64_t vocab) {
  const EmbeddingGradPlan plan = embedding_grad_plan(ids.as<int64_t>(), ids.numel(), vocab);
  DeviceGradPlan out;
  out.sorted_tokens = vector_to_device(plan.sorted_tokens, DType::i32);
  out.segment_offsets = vector_to_device(plan.segment_offsets, DType::i32);
  out.segment_ids = vector_to_device(plan.segment_ids, DType::i64);
  out.num_segments = static_cast<int64_t>(plan.segment_ids.size());
  return out;
}

void run_backward(const DeviceGradPlan& plan, const DeviceTensor& d_out, DeviceTensor& d_table, int64_t hidden,
                  cudaStream_t stream) {
  embedding_backward_cuda(plan.sorted_tokens.view.as<int32_t>(), plan.segment_offsets.view.as<int32_t>(),
                          plan.segment_ids.view.as<int64_t>(), plan.num_segments, f32_ptr(d_out), f32_ptr(d_table),
                          hidden, stream);
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
  const DeviceGradPlan plan = device_grad_plan(ids, vocab);
  const HostTensor d_table_start = to_host(d_table.view);
  run_backward(plan, d_out_d, d_table, hidden, nullptr);
  device_synchronize();
  // A rerun from the same start gives the same bits (each row sums its tokens in a fixed order).
  DeviceTensor d_table_again = to_device(d_table_start, DType::f32);
  run_backward(plan, d_out_d, d_table_again, hidden, nullptr);
  device_synchronize();
  EXPECT_TRUE(device_bytes_equal(d_table, d_table_again)) << "the backward is not deterministic";
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
  const DeviceGradPlan plan = device_grad_plan(to_host(ids.view), vocab);
  double bwd = median_ms([&](cudaStream_t s) { run_backward(plan, d_out, d_table, hidden, s); }, nullptr);
  print_bandwidth_timing("embedding bwd (per-id sums) 8192x2048", bwd, row_bytes * (4 + 8));
}

}  // namespace
}  // namespace deltamoe
