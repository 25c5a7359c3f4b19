// GPU test of the sum of squares behind the gradient norm (sum_of_squares_cuda.h) against the
// definition evaluated on the host: sum of fl32(fl64(g) / divisor)^2 in fp64. One-element sums are exact (the square of an
// fp32 value is exact in fp64), so each element's quotient is compared bit for bit, for a divisor
// of 1, integer divisors (the fp32 quotient path) and a fractional one (the fp64 path), over values
// of every magnitude including subnormal quotients. Long buffers, at every alignment of the start
// and with tails, are compared within fp64 summation-order noise, and so are span lists with
// extra sums. The bf16 form (values widened to fp32 first) the same way. Timing over a 1 GiB
// gradient.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/rng.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/common/sum_of_squares_cuda.h"
#include "kernels/common/sum_of_squares_host.h"

namespace deltamoe {
namespace {

// Values of many magnitudes: random mantissas with exponents from 2^-140 to 2^20, either sign,
// plus zeros and subnormals.
std::vector<float> varied_values(int64_t count, uint64_t seed) {
  std::vector<float> values(static_cast<size_t>(count));
  Rng rng(seed);
  for (int64_t i = 0; i < count; ++i) {
    float v;
    if (i % 97 == 0) {
      v = 0.0f;
    } else if (i % 89 == 0) {
      const uint32_t bits = rng.next_u32() & 0x007FFFFFu;  // subnormal
      std::memcpy(&v, &bits, sizeof(v));
    } else {
      v = std::ldexp(1.0f + rng.uniform(), static_cast<int>(rng.below(161)) - 140);
    }
    values[static_cast<size_t>(i)] = (rng.next_u32() & 1u) ? -v : v;
  }
  return values;
}

struct Device {
  DeviceBuffer grad, out, workspace;
  explicit Device(const std::vector<float>& values, int64_t outputs)
      : grad(values.size() * sizeof(float) + 16),
        out(static_cast<size_t>(outputs) * sizeof(double)),
        workspace(kSumOfSquaresWorkspaceBytes) {
    CUDA_CHECK(cudaMemcpy(grad.data(), values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  const float* at(int64_t i) const { return static_cast<const float*>(grad.data()) + i; }
  double* result(int64_t i) { return static_cast<double*>(out.data()) + i; }
  std::vector<double> results(int64_t n) const {
    std::vector<double> host(static_cast<size_t>(n));
    CUDA_CHECK(cudaMemcpy(host.data(), out.data(), host.size() * sizeof(double), cudaMemcpyDeviceToHost));
    return host;
  }
};

TEST(SumOfSquaresGpu, EachQuotientBitForBit) {
  const int64_t n = 4096;
  const std::vector<float> values = varied_values(n, 7);
  Device d(values, n);
  for (const double divisor : {1.0, 3.0, 8191.0, 4096.0, 65535.0, 16777215.0, 3.7, 1e-3}) {
    for (int64_t i = 0; i < n; ++i) sum_of_squares_cuda(d.at(i), 1, divisor, d.result(i), d.workspace.data(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<double> got = d.results(n);
    int64_t mismatches = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double want = host_sum_of_squares(&values[static_cast<size_t>(i)], 1, divisor);
      if (std::memcmp(&got[static_cast<size_t>(i)], &want, sizeof(double)) != 0) ++mismatches;
    }
    EXPECT_EQ(mismatches, 0) << "divisor " << divisor << ": elements whose squared quotient differs";
  }
}

TEST(SumOfSquaresGpu, LongBuffersEveryAlignmentAndTail) {
  const int64_t n = (int64_t{1} << 22) + 13;
  std::vector<float> values(static_cast<size_t>(n));
  Rng rng(11);
  for (float& v : values) v = static_cast<float>(rng.normal()) * 1e-3f;
  Device d(values, 4 * 6 * 3);
  int64_t k = 0;
  for (const int64_t start : {0, 1, 2, 3}) {
    for (const int64_t count : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{5}, int64_t{4099}, n - 4}) {
      for (const double divisor : {1.0, 8192.0, 12.5}) {
        sum_of_squares_cuda(d.at(start), count, divisor, d.result(k), d.workspace.data(), nullptr);
        CUDA_CHECK(cudaDeviceSynchronize());
        const double got = d.results(k + 1)[static_cast<size_t>(k)];
        const double want = host_sum_of_squares(&values[static_cast<size_t>(start)], count, divisor);
        // fp64 sums of up to 4M positive terms in another order: within ~1e-13 relative.
        EXPECT_NEAR(got, want, 1e-12 * want) << "start " << start << ", count " << count << ", divisor " << divisor;
        if (count == 0) {
          EXPECT_EQ(got, 0.0);
        }
        ++k;
      }
    }
  }
  // Deterministic: the same call gives the same bits.
  sum_of_squares_cuda(d.at(1), n - 4, 8192.0, d.result(0), d.workspace.data(), nullptr);
  sum_of_squares_cuda(d.at(1), n - 4, 8192.0, d.result(1), d.workspace.data(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<double> twice = d.results(2);
  EXPECT_EQ(std::memcmp(&twice[0], &twice[1], sizeof(double)), 0);
}

// Several spans of one buffer (any alignment, one empty, one overlapping another: a value counts
// once per span) plus extra sums: the host sum of each span and the extras, within fp64 order
// noise, the same bits on a second call; no spans sums the extras alone.
TEST(SumOfSquaresGpu, SpanListsWithExtraSums) {
  const int64_t n = (int64_t{1} << 20) + 7;
  std::vector<float> values(static_cast<size_t>(n));
  Rng rng(13);
  for (float& v : values) v = static_cast<float>(rng.normal()) * 3e-2f;
  Device d(values, 4);
  const std::vector<std::pair<int64_t, int64_t>> ranges = {{3, 1000}, {1003, 0}, {2048, 300001}, {2050, 17}, {400001, n - 400001}};
  std::vector<DeviceF32Span> spans;
  for (const auto& [first, count] : ranges) spans.push_back({d.at(first), count});
  DeviceBuffer span_array(spans.size() * sizeof(DeviceF32Span)), extra(3 * sizeof(double));
  CUDA_CHECK(cudaMemcpy(span_array.data(), spans.data(), span_array.bytes(), cudaMemcpyHostToDevice));
  const std::vector<double> extras = {0.25, 1.5e-3, 7.0};
  CUDA_CHECK(cudaMemcpy(extra.data(), extras.data(), extra.bytes(), cudaMemcpyHostToDevice));
  for (const double divisor : {1.0, 4099.0, 0.75}) {
    const auto* span_list = static_cast<const DeviceF32Span*>(span_array.data());
    const auto* extra_sums = static_cast<const double*>(extra.data());
    sum_of_squares_cuda(span_list, static_cast<int>(spans.size()), extra_sums, 3, divisor, d.result(0),
                        d.workspace.data(), nullptr);
    sum_of_squares_cuda(span_list, static_cast<int>(spans.size()), extra_sums, 3, divisor, d.result(1),
                        d.workspace.data(), nullptr);
    sum_of_squares_cuda(nullptr, 0, extra_sums, 3, divisor, d.result(2), d.workspace.data(), nullptr);
    sum_of_squares_cuda(span_list, static_cast<int>(spans.size()), nullptr, 0, divisor, d.result(3),
                        d.workspace.data(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<double> got = d.results(4);
    double spans_sum = 0.0;
    for (const auto& [first, count] : ranges)
      spans_sum += host_sum_of_squares(&values[static_cast<size_t>(first)], count, divisor);
    const double extras_sum = extras[0] + extras[1] + extras[2];
    EXPECT_NEAR(got[0], spans_sum + extras_sum, 1e-12 * (spans_sum + extras_sum)) << "divisor " << divisor;
    EXPECT_EQ(std::memcmp(&got[0], &got[1], sizeof(double)), 0) << "divisor " << divisor << ": not deterministic";
    EXPECT_NEAR(got[2], extras_sum, 1e-15 * extras_sum) << "divisor " << divisor << ": the extras alone";
    EXPECT_NEAR(got[3], spans_sum, 1e-12 * spans_sum) << "divisor " << divisor << ": the spans alone";
  }
}

// bf16 values (the f32 values above rounded, subnormals and zeros among them) against the host
// formula over their widened values: one-element sums bit for bit, long buffers at every start
// modulo 16 bytes (8 values a vector) and with tails within fp64 order noise, the same bits twice.
TEST(SumOfSquaresGpu, Bf16ValuesAsTheirWidenedFloats) {
  const int64_t n = (int64_t{1} << 21) + 11;
  const std::vector<float> raw = varied_values(n, 17);
  std::vector<uint16_t> bits(static_cast<size_t>(n));
  std::vector<float> widened(static_cast<size_t>(n));
  for (size_t i = 0; i < bits.size(); ++i) {
    bits[i] = float_to_bf16_bits(raw[i]);
    widened[i] = bf16_bits_to_float(bits[i]);
  }
  DeviceBuffer grad(bits.size() * sizeof(uint16_t) + 16), out(4096 * sizeof(double)),
      workspace(kSumOfSquaresWorkspaceBytes);
  CUDA_CHECK(cudaMemcpy(grad.data(), bits.data(), bits.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  const auto at = [&](int64_t i) { return static_cast<const __nv_bfloat16*>(grad.data()) + i; };
  const auto result = [&](int64_t i) { return static_cast<double*>(out.data()) + i; };
  const auto results = [&](int64_t count) {
    std::vector<double> host(static_cast<size_t>(count));
    CUDA_CHECK(cudaMemcpy(host.data(), out.data(), host.size() * sizeof(double), cudaMemcpyDeviceToHost));
    return host;
  };
  for (const double divisor : {1.0, 3.0, 8191.0, 16777215.0, 3.7, 1e-3}) {
    const int64_t singles = 4096;
    for (int64_t i = 0; i < singles; ++i)
      sum_of_squares_cuda(at(i), 1, divisor, result(i), workspace.data(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<double> got = results(singles);
    int64_t mismatches = 0;
    for (int64_t i = 0; i < singles; ++i) {
      const double want = host_sum_of_squares(&widened[static_cast<size_t>(i)], 1, divisor);
      if (std::memcmp(&got[static_cast<size_t>(i)], &want, sizeof(double)) != 0) ++mismatches;
    }
    EXPECT_EQ(mismatches, 0) << "divisor " << divisor << ": bf16 elements whose squared quotient differs";
  }
  for (const int64_t start : {0, 1, 3, 7, 8}) {
    for (const int64_t count : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{9}, int64_t{4099}, n - 8}) {
      for (const double divisor : {1.0, 8192.0, 12.5}) {
        sum_of_squares_cuda(at(start), count, divisor, result(0), workspace.data(), nullptr);
        CUDA_CHECK(cudaDeviceSynchronize());
        const double got = results(1)[0];
        const double want = host_sum_of_squares(&widened[static_cast<size_t>(start)], count, divisor);
        EXPECT_NEAR(got, want, 1e-12 * want) << "start " << start << ", count " << count << ", divisor " << divisor;
        if (count == 0) {
          EXPECT_EQ(got, 0.0);
        }
      }
    }
  }
  sum_of_squares_cuda(at(3), n - 8, 8191.0, result(0), workspace.data(), nullptr);
  sum_of_squares_cuda(at(3), n - 8, 8191.0, result(1), workspace.data(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<double> twice = results(2);
  EXPECT_EQ(std::memcmp(&twice[0], &twice[1], sizeof(double)), 0);
}

TEST(SumOfSquaresGpu, Timing1GiB) {
  const int64_t n = int64_t{1} << 28;
  DeviceBuffer grad(static_cast<size_t>(n) * sizeof(float)), out(sizeof(double)),
      workspace(kSumOfSquaresWorkspaceBytes);
  CUDA_CHECK(cudaMemset(grad.data(), 0x3c, static_cast<size_t>(n) * sizeof(float)));
  for (const double divisor : {8192.0, 12.5}) {
    const double ms = median_ms(
        [&](cudaStream_t s) {
          sum_of_squares_cuda(static_cast<const float*>(grad.data()), n, divisor, static_cast<double*>(out.data()),
                                   workspace.data(), s);
        },
        nullptr);
    print_bandwidth_timing(divisor == 8192.0 ? "sum of squares, 1 GiB, integer divisor"
                                             : "sum of squares, 1 GiB, fractional divisor",
                           ms, static_cast<double>(n) * sizeof(float));
  }
}

}  // namespace
}  // namespace deltamoe
