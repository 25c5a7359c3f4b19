// GPU test of the grouped GEMM against its CPU reference, for every kernel this process may run
// (wgmma, which sm_90a callers get, on the sm_90a kernel path only; mma.sync, the sm_80 path; the
// WMMA fallback): row-grouped products (weights [N, K] and [K, N], bf16 and f32 outputs) and weight
// gradients in f32 and bf16 ("added to" and "written", with the written one's sum of squares), over
// empty groups, single rows, odd sizes, K not a multiple of the k-step and the Qwen3.5-35B-A3B
// expert widths; then timing side by side at 8192 tokens x 8 experts, and under three routings.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/parallel_ranges.h"
#include "core/rng.h"
#include "kernels/common/kernel_path_cuda.h"
#include "kernels/common/tensor_compare.h"
#include "kernels/common/sum_of_squares_host.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/grouped_gemm/grouped_gemm.h"
#include "kernels/grouped_gemm/grouped_gemm_cuda.h"
#include "kernels/grouped_gemm/grouped_gemm_kernels_cuda.h"

namespace deltamoe {
namespace {

// Group offsets: groups floor(i * G / empty_groups) get no row (group 0 among them); every other
// row goes to a random one of the remaining groups.
std::vector<int32_t> random_offsets(int64_t rows, int64_t groups, int64_t empty_groups, uint64_t seed) {
  std::vector<bool> empty(groups, false);
  for (int64_t i = 0; i < empty_groups; ++i) empty[i * groups / empty_groups] = true;
  std::vector<int64_t> used;
  for (int64_t g = 0; g < groups; ++g)
    if (!empty[g]) used.push_back(g);
  Rng rng(seed);
  std::vector<int32_t> counts(groups, 0);
  for (int64_t r = 0; r < rows; ++r) counts[used[rng.below(used.size())]] += 1;
  std::vector<int32_t> offsets(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) offsets[g + 1] = offsets[g] + counts[g];
  return offsets;
}

DeviceTensor offsets_to_device(const std::vector<int32_t>& offsets) {
  HostTensor host(DType::i32, {static_cast<int64_t>(offsets.size())});
  std::copy(offsets.begin(), offsets.end(), host.as<int32_t>());
  return to_device(host);
}

struct GroupedShape {
  int64_t rows, groups, empty_groups, n, k;
};

// Every kernel choice this process may run is checked against one reference product: `auto` (what
// callers get), the WMMA fallback, both block tiles of the mma.sync kernel (which fall back to WMMA
// at shapes the mma kernel does not take) and, on the sm_90a kernel path, wgmma (which raises on
// the sm_80 path: WgmmaFollowsTheKernelPath).
std::vector<GroupedGemmKernel> kernels_here() {
  std::vector<GroupedGemmKernel> kernels = {GroupedGemmKernel::automatic, GroupedGemmKernel::wmma,
                                            GroupedGemmKernel::mma_128x128, GroupedGemmKernel::mma_128x256};
  if (grouped_gemm_detail::wgmma_available()) kernels.push_back(GroupedGemmKernel::wgmma);
  return kernels;
}

const char* kernel_name(GroupedGemmKernel kernel) {
  switch (kernel) {
    case GroupedGemmKernel::wmma:
      return "wmma";
    case GroupedGemmKernel::mma_128x128:
      return "mma 128x128";
    case GroupedGemmKernel::mma_128x256:
      return "mma 128x256";
    case GroupedGemmKernel::wgmma:
      return "wgmma";
    default:
      return "auto";
  }
}

void check_rows(const GroupedShape& s, bool b_stored_nk, uint64_t seed) {
  std::printf("rows-grouped R=%lld G=%lld (empty %lld) N=%lld K=%lld b=%s\n", static_cast<long long>(s.rows),
              static_cast<long long>(s.groups), static_cast<long long>(s.empty_groups), static_cast<long long>(s.n),
              static_cast<long long>(s.k), b_stored_nk ? "[N,K]" : "[K,N]");
  const std::vector<int32_t> offsets = random_offsets(s.rows, s.groups, s.empty_groups, seed);
  HostTensor a = random_bf16_exact({s.rows, s.k}, seed + 1);
  HostTensor b = random_bf16_exact({s.groups, b_stored_nk ? s.n : s.k, b_stored_nk ? s.k : s.n}, seed + 2,
                                   1.0f / std::sqrt(static_cast<float>(s.k)));
  HostTensor c_ref(DType::f32, {s.rows, s.n});
  grouped_gemm_rows_ref(a.as<float>(), b.as<float>(), b_stored_nk, c_ref.as<float>(), offsets.data(), s.groups, s.n,
                        s.k);

  DeviceTensor a_d = to_device(a, DType::bf16), b_d = to_device(b, DType::bf16), off_d = offsets_to_device(offsets);
  DeviceBuffer workspace(grouped_gemm_rows_workspace_bytes(s.groups));
  for (GroupedGemmKernel kernel : kernels_here()) {
    for (DType out_dtype : {DType::bf16, DType::f32}) {
      DeviceTensor c_d = device_tensor(out_dtype, {s.rows, s.n});
      device_fill_bytes(c_d.view, 0xFF);
      grouped_gemm_rows_cuda_with(kernel, bf16_ptr(a_d), bf16_ptr(b_d), b_stored_nk, c_d.view.data, out_dtype,
                                  static_cast<const int32_t*>(off_d.view.data), s.groups, s.rows, s.n, s.k,
                                  workspace.data(), workspace.bytes(), nullptr);
      device_synchronize();
      // bf16 output: one rounding (2^-9 relative) -> rel_l2 <= 1e-2; f32 output: only summation order.
      const std::string name =
          std::string(out_dtype == DType::bf16 ? "c (bf16) [" : "c (f32) [") + kernel_name(kernel) + "]";
      CompareResult r = compare_tensors(name, to_host(c_d.view), c_ref);
      EXPECT_TRUE(r.all_finite);
      EXPECT_LE(r.rel_l2, out_dtype == DType::bf16 ? 1e-2 : 1e-4);
    }
  }
}

// grouped_gemm_weight_grad_ref with the groups split between the host's threads: each group's
// sums are those of one call, in the same order (the 35B widths' references take minutes on one).
template <typename T>
void weight_grad_ref_threaded(const T* a, const T* b, T* c, const std::vector<int32_t>& offsets, int64_t groups,
                              int64_t m, int64_t n) {
  parallel_ranges(groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<int32_t> local(offsets.begin() + g0, offsets.begin() + g1 + 1);
    const int32_t first_row = local[0];
    for (int32_t& offset : local) offset -= first_row;
    grouped_gemm_weight_grad_ref(a + first_row * m, b + first_row * n, c + g0 * m * n, local.data(), g1 - g0, m, n);
  });
}

// A weight-gradient case's operands (c_g [M, N] with M = s.n and N = s.k, K = each group's rows),
// announced with its sizes: the f32 and bf16 checks draw the same ones from the same seed.
struct WeightGradOperands {
  int64_t m, n;
  std::vector<int32_t> offsets;
  HostTensor a, b;
};

WeightGradOperands weight_grad_operands(const GroupedShape& s, uint64_t seed, const char* label) {
  const int64_t m = s.n, n = s.k;
  std::printf("%s R=%lld G=%lld (empty %lld) M=%lld N=%lld\n", label, static_cast<long long>(s.rows),
              static_cast<long long>(s.groups), static_cast<long long>(s.empty_groups), static_cast<long long>(m),
              static_cast<long long>(n));
  std::vector<int32_t> offsets = random_offsets(s.rows, s.groups, s.empty_groups, seed);
  HostTensor a = random_bf16_exact({s.rows, m}, seed + 1);
  HostTensor b = random_bf16_exact({s.rows, n}, seed + 2);
  return {m, n, std::move(offsets), std::move(a), std::move(b)};
}

// Both outputs against the reference: "added to" on top of random values, "written" over a
// poisoned c (every element, empty groups' zeros included, must be stored) against the reference
// summed onto zeros.
void check_weight_grad(const GroupedShape& s, uint64_t seed) {
  const auto [m, n, offsets, a, b] = weight_grad_operands(s, seed, "weight-grad");
  HostTensor c_init = random_normal_tensor({s.groups, m, n}, seed + 3);
  HostTensor c_ref = random_normal_tensor({s.groups, m, n}, seed + 3);
  weight_grad_ref_threaded(a.as<float>(), b.as<float>(), c_ref.as<float>(), offsets, s.groups, m, n);
  HostTensor c_ref_written(DType::f32, {s.groups, m, n});
  std::fill(c_ref_written.as<float>(), c_ref_written.as<float>() + c_ref_written.numel(), 0.0f);
  weight_grad_ref_threaded(a.as<float>(), b.as<float>(), c_ref_written.as<float>(), offsets, s.groups, m, n);

  DeviceTensor a_d = to_device(a, DType::bf16), b_d = to_device(b, DType::bf16), off_d = offsets_to_device(offsets);
  for (GroupedGemmKernel kernel : kernels_here()) {
    for (WeightGradOutput output : {WeightGradOutput::added_to, WeightGradOutput::written}) {
      const bool added = output == WeightGradOutput::added_to;
      DeviceTensor c_d = to_device(c_init, DType::f32);
      if (!added) device_fill_bytes(c_d.view, 0xFF);
      grouped_gemm_weight_grad_cuda_with(kernel, bf16_ptr(a_d), bf16_ptr(b_d), c_d.view.data, DType::f32,
                                         static_cast<const int32_t*>(off_d.view.data), s.groups, m, n, output,
                                         nullptr);
      device_synchronize();
      const std::string name =
          std::string(added ? "c (f32, added to) [" : "c (f32, written) [") + kernel_name(kernel) + "]";
      CompareResult r = compare_tensors(name, to_host(c_d.view), added ? c_ref : c_ref_written);
      EXPECT_TRUE(r.all_finite);
      EXPECT_LE(r.rel_l2, 1e-4);
    }
  }
}

// A bf16 dW stores the fp32 product p rounded to nearest even (added to: bf16_rn(fl32(c + p))).
// Two checks. (1) Against the same kernel's f32 gradient from the same start, rounded on the host:
// bit for bit, since a kernel accumulates the same p whatever c's type (and adds c the same way).
// (2) Against the fp64 reference, independently of the f32 path: each stored value between the
// bf16 roundings of the ends of an interval known to hold p (or fl32(c + p)); bf16 rounding is
// monotone. The interval: the fp64 product (exact but for fp64's own roundings, ~2^-45 relative)
// widened by K_g 2^-22 sum |a b|, twice the worst case of fp32 sums of K_g terms in any order with
// truncating adds (the tensor cores' accumulation), K_g the group's rows; added to, further by
// 2^-23 |c + p|, twice the fp32 add's rounding. That is the f32 error bound plus bf16's rounding
// (at most 2^-8 |p|), and where the interval holds no rounding boundary (most elements of small
// groups) exactly the correctly rounded value.
struct Bf16WeightGradReference {
  HostTensor product;  // f64 [G, M, N]: c_g = a_g^T b_g
  HostTensor error;    // f64 [G, M, N]: K_g 2^-22 sum over the group's rows of |a b|
};

Bf16WeightGradReference bf16_weight_grad_reference(const HostTensor& a, const HostTensor& b,
                                                   const std::vector<int32_t>& offsets, int64_t groups, int64_t m,
                                                   int64_t n) {
  const auto widen = [](const HostTensor& t, bool magnitude) {
    std::vector<double> out(static_cast<size_t>(t.numel()));
    for (int64_t i = 0; i < t.numel(); ++i) {
      const double v = t.as<float>()[i];
      out[static_cast<size_t>(i)] = magnitude ? std::fabs(v) : v;
    }
    return out;
  };
  Bf16WeightGradReference r;
  r.product = HostTensor(DType::f64, {groups, m, n});  // zeros
  r.error = HostTensor(DType::f64, {groups, m, n});
  double* error = r.error.as<double>();
  weight_grad_ref_threaded(widen(a, false).data(), widen(b, false).data(), r.product.as<double>(), offsets, groups, m,
                           n);
  weight_grad_ref_threaded(widen(a, true).data(), widen(b, true).data(), error, offsets, groups, m, n);
  parallel_ranges(groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const double k_g = offsets[static_cast<size_t>(g) + 1] - offsets[static_cast<size_t>(g)];
      for (int64_t i = g * m * n; i < (g + 1) * m * n; ++i) error[i] *= k_g * 0x1p-22;
    }
  });
  return r;
}

// Stored bf16 values outside [bf16_rn(lo), bf16_rn(hi)], lo and hi the floats just outside
// [want - error, want + error] (NaN or an unwritten value among them), want the reference product
// plus c_start's value where added to (c_start null: written). Prints the first few and a summary.
int64_t bf16_rounding_misses(const std::string& name, const HostTensor& got_bf16, const Bf16WeightGradReference& ref,
                             const HostTensor* c_start) {
  const HostTensor got = got_bf16.to_f32();
  // Ranges on the host's threads (hundreds of millions of elements at the 35B widths), each with
  // its own tallies and first misses, merged in range order.
  struct Tally {
    int64_t misses = 0;
    double diff_sq = 0, want_sq = 0, max_diff = 0;
    std::vector<std::string> first;  // up to 5 lines, in element order
  };
  const int64_t count = got.numel();
  const int64_t ranges = std::max<int64_t>(1, std::min<int64_t>(64, count >> 16));
  std::vector<Tally> tallies(static_cast<size_t>(ranges));
  const double* product = ref.product.as<double>();
  const double* bound = ref.error.as<double>();
  const float* values = got.as<float>();
  const float* start = c_start != nullptr ? c_start->as<float>() : nullptr;
  parallel_ranges(ranges, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t range = r0; range < r1; ++range) {
      Tally& t = tallies[static_cast<size_t>(range)];
      const int64_t begin = range * count / ranges, end = (range + 1) * count / ranges;
      for (int64_t i = begin; i < end; ++i) {
        double want = product[i], error = bound[i];
        if (start != nullptr) {
          want += start[i];
          error += 0x1p-23 * (std::fabs(want) + error);
        }
        const float lo = round_to_bf16(std::nextafter(static_cast<float>(want - error), -INFINITY));
        const float hi = round_to_bf16(std::nextafter(static_cast<float>(want + error), INFINITY));
        const float v = values[i];
        const double diff = static_cast<double>(v) - want;
        t.diff_sq += diff * diff;
        t.want_sq += want * want;
        t.max_diff = std::max(t.max_diff, std::fabs(diff));
        if (v >= lo && v <= hi) continue;
        if (t.first.size() < 5) {
          char line[256];
          std::snprintf(line, sizeof(line),
                        "    %s: element %lld is %.9g, want bf16 in [%.9g, %.9g] (reference %.17g +- %.3g)\n",
                        name.c_str(), static_cast<long long>(i), v, lo, hi, want, error);
          t.first.emplace_back(line);
        }
        ++t.misses;
      }
    }
  });
  Tally all;
  for (const Tally& t : tallies) {
    for (const std::string& line : t.first)
      if (all.first.size() < 5) all.first.push_back(line);
    all.misses += t.misses;
    all.diff_sq += t.diff_sq;
    all.want_sq += t.want_sq;
    all.max_diff = std::max(all.max_diff, t.max_diff);
  }
  for (const std::string& line : all.first) std::printf("%s", line.c_str());
  std::printf("  %-40s n=%-9lld max|diff| %.3e  rel_l2 %.3e  outside the interval: %lld\n", name.c_str(),
              static_cast<long long>(count), all.max_diff, all.want_sq > 0 ? std::sqrt(all.diff_sq / all.want_sq) : 0.0,
              static_cast<long long>(all.misses));
  return all.misses;
}

// bf16 c on every kernel: "added to" on top of random bf16 values, "written" over a poisoned c
// (NaN bits): bit for bit the f32 gradient rounded, and within bf16_rounding_misses' bounds.
void check_weight_grad_bf16(const GroupedShape& s, uint64_t seed) {
  const auto [m, n, offsets, a, b] = weight_grad_operands(s, seed, "weight-grad bf16");
  const Bf16WeightGradReference ref = bf16_weight_grad_reference(a, b, offsets, s.groups, m, n);
  const HostTensor c_init = random_normal_tensor({s.groups, m, n}, seed + 3).to_dtype(DType::bf16);
  const HostTensor c_init_f32 = c_init.to_f32();

  DeviceTensor a_d = to_device(a, DType::bf16), b_d = to_device(b, DType::bf16), off_d = offsets_to_device(offsets);
  for (GroupedGemmKernel kernel : kernels_here()) {
    for (WeightGradOutput output : {WeightGradOutput::added_to, WeightGradOutput::written}) {
      const bool added = output == WeightGradOutput::added_to;
      HostTensor got[2];  // f32, bf16
      for (const DType c_dtype : {DType::f32, DType::bf16}) {
        DeviceTensor c_d = to_device(c_init, c_dtype);
        if (!added) device_fill_bytes(c_d.view, 0xFF);
        grouped_gemm_weight_grad_cuda_with(kernel, bf16_ptr(a_d), bf16_ptr(b_d), c_d.view.data, c_dtype,
                                           static_cast<const int32_t*>(off_d.view.data), s.groups, m, n, output,
                                           nullptr);
        device_synchronize();
        got[c_dtype == DType::bf16 ? 1 : 0] = to_host(c_d.view);
      }
      const std::string name =
          std::string(added ? "c (bf16, added to) [" : "c (bf16, written) [") + kernel_name(kernel) + "]";
      const HostTensor rounded = got[0].to_dtype(DType::bf16);
      const auto* got_bits = static_cast<const uint16_t*>(got[1].data());
      const auto* want_bits = static_cast<const uint16_t*>(rounded.data());
      std::atomic<int64_t> differing{0};
      parallel_ranges(rounded.numel(), int64_t{1} << 20, [&](int64_t begin, int64_t end) {
        int64_t here = 0;
        for (int64_t i = begin; i < end; ++i) here += got_bits[i] != want_bits[i];
        differing += here;
      });
      EXPECT_EQ(differing.load(), 0) << name << ": elements not the f32 gradient rounded to nearest even";
      EXPECT_EQ(bf16_rounding_misses(name, got[1], ref, added ? &c_init_f32 : nullptr), 0)
          << name << ": stored values outside the bf16 roundings of the reference's interval";
    }
  }
}

// Shapes with N and K multiples of 8 take the mma.sync kernel under `auto`; the others the WMMA
// kernel under both names. In weight-grad checks N is M and K is N of c_g, and K of the product is
// each group's row count (rarely a multiple of 8 or 32). The 35B widths are their own tests
// (*Widths35B): their CPU references and 2 GB weight tensors take minutes, and a reduced pass
// (tools/gpu/sm80_path.sh) leaves them out with --gtest_filter=-*Widths35B*.
const GroupedShape kShapes[] = {
    {1, 1, 0, 16, 16},           // one row
    {1, 4, 3, 24, 40},           // one row, three empty groups
    {50, 4, 1, 8, 8},            // K = 8: a quarter of one k-step; N = 8
    {300, 5, 2, 64, 96},         // empty groups between used ones, partial tiles
    {513, 7, 1, 136, 72},        // groups larger than one 128-row tile, K = 72 not a multiple of 32
    {1200, 2, 0, 264, 200},      // groups of ~600 rows (4-5 m-tiles), 3 n-tiles, K % 32 = 8
    {700, 9, 3, 392, 1000},      // many k-steps (pipeline wrap-around), K % 32 = 8
    {97, 6, 2, 37, 53},          // odd N and K: the element-by-element path (WMMA only)
    {260, 3, 0, 129, 131},       // odd, more than one tile each way (WMMA only)
};
const GroupedShape kShapes35B[] = {
    {512, 256, 40, 1024, 2048},  // 35B gate_up widths (E=256, N=2I, K=H), 64 tokens x 8; ~1700
                                 // tiles, so each persistent block of the mma kernel takes several
    {512, 256, 40, 2048, 512},   // 35B down widths
};

TEST(GroupedGemmGpu, RowsMatchReference) {
  uint64_t seed = 100;
  for (const GroupedShape& s : kShapes) {
    for (bool nk : {true, false}) check_rows(s, nk, seed += 20);
  }
}

TEST(GroupedGemmGpu, RowsMatchReferenceWidths35B) {
  uint64_t seed = 460;  // the seeds these shapes had at the end of kShapes
  for (const GroupedShape& s : kShapes35B) {
    for (bool nk : {true, false}) check_rows(s, nk, seed += 20);
  }
}

TEST(GroupedGemmGpu, WeightGradMatchesReference) {
  uint64_t seed = 900;
  for (const GroupedShape& s : kShapes) check_weight_grad(s, seed += 10);
}

TEST(GroupedGemmGpu, WeightGradMatchesReferenceWidths35B) {
  uint64_t seed = 990;  // as above
  for (const GroupedShape& s : kShapes35B) check_weight_grad(s, seed += 10);
}

TEST(GroupedGemmGpu, Bf16WeightGradMatchesReference) {
  uint64_t seed = 900;  // the f32 cases' operands
  for (const GroupedShape& s : kShapes) check_weight_grad_bf16(s, seed += 10);
}

TEST(GroupedGemmGpu, Bf16WeightGradMatchesReferenceWidths35B) {
  uint64_t seed = 990;
  for (const GroupedShape& s : kShapes35B) check_weight_grad_bf16(s, seed += 10);
}

// A written dW (f32 and bf16) with its sum of squares (WeightGradSquares), on every kernel: c bit for
// bit what the product without the sum stores; the sum that of the stored c (bf16: the rounded
// values) within its bound (fp64 order noise, or kWrittenSquaresRelError(Bf16) where formed in the
// epilogue), for a divisor of 1, an integer and a fraction; the same bits on a second call. The
// last shape gives every wgmma block several tiles (groups without rows among them).
TEST(GroupedGemmGpu, WrittenWeightGradSumsItsSquares) {
  const GroupedShape shapes[] = {{1, 4, 3, 24, 40}, {300, 5, 2, 64, 96}, {1200, 2, 0, 264, 200},
                                 {97, 6, 2, 37, 53}, {3000, 64, 9, 256, 512}};
  uint64_t seed = 1300;
  for (const GroupedShape& s : shapes) {
    const int64_t m = s.n, n = s.k;
    const std::vector<int32_t> offsets = random_offsets(s.rows, s.groups, s.empty_groups, seed += 10);
    HostTensor a = random_bf16_exact({s.rows, m}, seed + 1), b = random_bf16_exact({s.rows, n}, seed + 2);
    DeviceTensor a_d = to_device(a, DType::bf16), b_d = to_device(b, DType::bf16), off_d = offsets_to_device(offsets);
    const auto* offsets_d = static_cast<const int32_t*>(off_d.view.data);
    DeviceBuffer sums(2 * sizeof(double)), scratch(kWeightGradSquaresScratchBytes);
    for (GroupedGemmKernel kernel : kernels_here()) {
      for (const DType c_dtype : {DType::f32, DType::bf16}) {
        const std::string name = std::string(kernel_name(kernel)) + ", " + std::string(dtype_name(c_dtype));
        DeviceTensor plain = device_tensor(c_dtype, {s.groups, m, n});
        device_fill_bytes(plain.view, 0xFF);
        grouped_gemm_weight_grad_cuda_with(kernel, bf16_ptr(a_d), bf16_ptr(b_d), plain.view.data, c_dtype, offsets_d,
                                           s.groups, m, n, WeightGradOutput::written, nullptr);
        const HostTensor c = to_host(plain.view);
        for (const double divisor : {1.0, 4099.0, 0.37}) {
          std::vector<double> got(2);
          for (int call = 0; call < 2; ++call) {
            DeviceTensor with = device_tensor(c_dtype, {s.groups, m, n});
            device_fill_bytes(with.view, 0xFF);
            const WeightGradSquares squares{static_cast<double*>(sums.data()) + call, divisor, scratch.data()};
            grouped_gemm_weight_grad_cuda_with(kernel, bf16_ptr(a_d), bf16_ptr(b_d), with.view.data, c_dtype,
                                               offsets_d, s.groups, m, n, WeightGradOutput::written, nullptr,
                                               &squares);
            if (call == 0) {
              EXPECT_TRUE(device_bytes_equal(plain, with))
                  << name << ", M=" << m << " N=" << n << ": the sum changed what is stored";
            }
          }
          CUDA_CHECK(cudaMemcpy(got.data(), sums.data(), 2 * sizeof(double), cudaMemcpyDeviceToHost));
          const double want = host_sum_of_squares(c, divisor);
          std::printf("dW squares [%s] M=%lld N=%lld divisor %g: %.17g (host %.17g)\n", name.c_str(),
                      static_cast<long long>(m), static_cast<long long>(n), divisor, got[0], want);
          // wgmma sums the undivided squares in its epilogue; the others' pass sums the quotients'.
          // automatic and wgmma take the wgmma kernel where its alignment rules hold on the sm_90a path.
          const bool ran_wgmma =
              (kernel == GroupedGemmKernel::automatic || kernel == GroupedGemmKernel::wgmma) &&
              grouped_gemm_detail::wgmma_available() &&
              grouped_gemm_detail::mma_applies(a_d.view.data, b_d.view.data, plain.view.data, m, n);
          // The pass and the host add the same fp64 terms in other orders: nonnegative terms, so
          // each sum is within (count - 1) u of the exact one (u = 2^-53), and the two within twice that.
          const double order_bound = 2.0 * static_cast<double>(s.groups * m * n) * 0x1p-53;
          const double epilogue_bound =
              c_dtype == DType::bf16 ? kWrittenSquaresRelErrorBf16 : kWrittenSquaresRelError;
          const double bound = ran_wgmma ? epilogue_bound : order_bound;
          EXPECT_NEAR(got[0], want, bound * want) << name << ", M=" << m << " N=" << n;
          EXPECT_EQ(std::memcmp(&got[0], &got[1], sizeof(double)), 0) << name << ": not deterministic";
        }
      }
    }
  }
}

// Asking for wgmma by name runs it on the sm_90a kernel path and raises on the sm_80 path (an
// A800, or compute_80 code on the H200), where the binary's copy of the kernel may be empty.
TEST(GroupedGemmGpu, WgmmaFollowsTheKernelPath) {
  const KernelPath& path = kernel_path();
  std::printf("kernel path: %s; wgmma kernel available: %s\n", path.describe().c_str(),
              grouped_gemm_detail::wgmma_available() ? "yes" : "no");
  EXPECT_EQ(grouped_gemm_detail::wgmma_available(), path.sm90a);
  if (path.sm90a) return;  // RowsMatchReference checks its results
  const GroupedShape s{256, 2, 0, 64, 64};
  const std::vector<int32_t> offsets = random_offsets(s.rows, s.groups, s.empty_groups, 3);
  DeviceTensor a_d = to_device(random_bf16_exact({s.rows, s.k}, 4), DType::bf16);
  DeviceTensor b_d = to_device(random_bf16_exact({s.groups, s.n, s.k}, 5), DType::bf16);
  DeviceTensor off_d = offsets_to_device(offsets);
  DeviceTensor c_d = device_tensor(DType::f32, {s.rows, s.n});
  DeviceTensor dw_d = device_tensor(DType::f32, {s.groups, s.k, s.k});
  DeviceBuffer workspace(grouped_gemm_rows_workspace_bytes(s.groups));
  EXPECT_THROW(grouped_gemm_rows_cuda_with(GroupedGemmKernel::wgmma, bf16_ptr(a_d), bf16_ptr(b_d), true,
                                           c_d.view.data, DType::f32, static_cast<const int32_t*>(off_d.view.data),
                                           s.groups, s.rows, s.n, s.k, workspace.data(), workspace.bytes(), nullptr),
               Error);
  EXPECT_THROW(grouped_gemm_weight_grad_cuda_with(GroupedGemmKernel::wgmma, bf16_ptr(a_d), bf16_ptr(a_d),
                                                  dw_d.view.data, DType::f32,
                                                  static_cast<const int32_t*>(off_d.view.data), s.groups, s.k, s.k,
                                                  WeightGradOutput::added_to, nullptr),
               Error);
  device_synchronize();
}

TEST(GroupedGemmGpu, MisalignedOperandsFallBack) {
  // An A that starts 2 bytes past a 16-byte boundary cannot take 16-byte copies: the launcher must
  // still give the right product (through the WMMA kernel's element path).
  const GroupedShape s{200, 3, 0, 64, 72};
  const std::vector<int32_t> offsets = random_offsets(s.rows, s.groups, s.empty_groups, 55);
  HostTensor a = random_bf16_exact({s.rows * s.k + 1}, 56), b = random_bf16_exact({s.groups, s.n, s.k}, 57, 0.1f);
  HostTensor c_ref(DType::f32, {s.rows, s.n});
  grouped_gemm_rows_ref(a.as<float>() + 1, b.as<float>(), true, c_ref.as<float>(), offsets.data(), s.groups, s.n, s.k);
  DeviceTensor a_d = to_device(a, DType::bf16), b_d = to_device(b, DType::bf16), off_d = offsets_to_device(offsets);
  DeviceTensor c_d = device_tensor(DType::f32, {s.rows, s.n});
  device_fill_bytes(c_d.view, 0xFF);
  DeviceBuffer workspace(grouped_gemm_rows_workspace_bytes(s.groups));
  grouped_gemm_rows_cuda(bf16_ptr(a_d) + 1, bf16_ptr(b_d), true, c_d.view.data, DType::f32,
                         static_cast<const int32_t*>(off_d.view.data), s.groups, s.rows, s.n, s.k, workspace.data(),
                         workspace.bytes(), nullptr);
  device_synchronize();
  CompareResult r = compare_tensors("c (f32, A misaligned)", to_host(c_d.view), c_ref);
  EXPECT_TRUE(r.all_finite);
  EXPECT_LE(r.rel_l2, 1e-4);
}

TEST(GroupedGemmGpu, LaunchOverUpperBoundLeavesLaterRowsAlone) {
  // max_rows larger than the routed rows (offsets[G] < max_rows): rows past the end stay poisoned.
  const int64_t groups = 4, routed = 200, max_rows = 260, n = 32, k = 64;
  std::vector<int32_t> offsets = random_offsets(routed, groups, 1, 7);
  HostTensor a = random_bf16_exact({max_rows, k}, 8), b = random_bf16_exact({groups, n, k}, 9);
  DeviceTensor a_d = to_device(a, DType::bf16), b_d = to_device(b, DType::bf16), off_d = offsets_to_device(offsets);
  DeviceTensor c_d = device_tensor(DType::f32, {max_rows, n});
  device_fill_bytes(c_d.view, 0xFF);
  DeviceBuffer workspace(grouped_gemm_rows_workspace_bytes(groups));
  grouped_gemm_rows_cuda(bf16_ptr(a_d), bf16_ptr(b_d), true, c_d.view.data, DType::f32,
                         static_cast<const int32_t*>(off_d.view.data), groups, max_rows, n, k, workspace.data(),
                         workspace.bytes(), nullptr);
  HostTensor c = to_host(c_d.view);
  int64_t finite_rows = 0, poisoned_tail = 0;
  for (int64_t r = 0; r < max_rows; ++r) {
    const bool finite = std::isfinite(c.as<float>()[r * n]);
    if (r < routed)
      finite_rows += finite;
    else
      poisoned_tail += !finite;
  }
  std::printf("  routed rows written %lld/%lld, tail rows untouched %lld/%lld\n", static_cast<long long>(finite_rows),
              static_cast<long long>(routed), static_cast<long long>(poisoned_tail),
              static_cast<long long>(max_rows - routed));
  EXPECT_EQ(finite_rows, routed);
  EXPECT_EQ(poisoned_tail, max_rows - routed);
}

TEST(GroupedGemmGpu, BadSizesAreRefused) {
  DeviceBuffer workspace(16);
  EXPECT_THROW(grouped_gemm_rows_cuda(nullptr, nullptr, true, nullptr, DType::bf16, nullptr, 0, 8, 8, 8,
                                      workspace.data(), workspace.bytes(), nullptr),
               Error);
  EXPECT_THROW(grouped_gemm_rows_cuda(nullptr, nullptr, true, nullptr, DType::bf16, nullptr, 8, 8, 8, 8,
                                      workspace.data(), 4, nullptr),
               Error);
  EXPECT_THROW(grouped_gemm_weight_grad_cuda(nullptr, nullptr, nullptr, DType::f32, nullptr, 4, 0, 8,
                                             WeightGradOutput::written, nullptr),
               Error);
  // A gradient neither f32 nor bf16.
  DeviceTensor a_d = to_device(random_bf16_exact({64, 8}, 3), DType::bf16);
  DeviceTensor off_d = offsets_to_device({0, 32, 64});
  DeviceTensor dw_f16 = device_tensor(DType::f16, {2, 8, 8});
  for (WeightGradOutput output : {WeightGradOutput::added_to, WeightGradOutput::written}) {
    EXPECT_THROW(grouped_gemm_weight_grad_cuda(bf16_ptr(a_d), bf16_ptr(a_d), dw_f16.view.data, DType::f16,
                                               static_cast<const int32_t*>(off_d.view.data), 2, 8, 8, output, nullptr),
                 Error);
  }
}

// Qwen3.5-35B-A3B at 8192 tokens: R = 65536 routed rows over 256 experts (uniform random routing).
TEST(GroupedGemmGpu, Timing35B) {
  const int64_t tokens = 8192, top_k = 8, rows = tokens * top_k, experts = 256, hidden = 2048, inter = 512;
  const std::vector<int32_t> offsets = random_offsets(rows, experts, 0, 77);
  DeviceTensor off_d = offsets_to_device(offsets);
  const int32_t* off = static_cast<const int32_t*>(off_d.view.data);
  DeviceTensor x = to_device(pattern_tensor({rows, hidden}, 1, 1.0f), DType::bf16);
  DeviceTensor h = to_device(pattern_tensor({rows, 2 * inter}, 2, 1.0f), DType::bf16);
  DeviceTensor w_gu = to_device(pattern_tensor({experts, 2 * inter, hidden}, 3, 0.02f), DType::bf16);
  DeviceTensor w_down = to_device(pattern_tensor({experts, hidden, inter}, 4, 0.02f), DType::bf16);
  DeviceTensor gu = device_tensor(DType::bf16, {rows, 2 * inter});
  DeviceTensor y = device_tensor(DType::bf16, {rows, hidden});
  DeviceTensor d_h = device_tensor(DType::f32, {rows, inter});
  DeviceTensor d_gu_w = device_tensor(DType::f32, {experts, 2 * inter, hidden});
  DeviceTensor d_down_w = device_tensor(DType::f32, {experts, hidden, inter});
  DeviceTensor d_gu_w_bf16 = device_tensor(DType::bf16, {experts, 2 * inter, hidden});
  DeviceTensor d_down_w_bf16 = device_tensor(DType::bf16, {experts, hidden, inter});
  for (DeviceTensor* t : {&d_gu_w, &d_down_w, &d_gu_w_bf16, &d_down_w_bf16}) device_fill_bytes(t->view, 0);
  DeviceBuffer workspace(grouped_gemm_rows_workspace_bytes(experts));
  const double gu_flops = 2.0 * rows * (2 * inter) * hidden, down_flops = 2.0 * rows * hidden * inter;
  // Row products timed with the mma.sync kernel (128x256, the sm_80 path) and, on the sm_90a
  // path, the wgmma kernel (what sm_90a callers get); dW with the mma.sync kernel (128x128: "added
  // to" on both paths, "written" as zeroing + sum on the sm_80 path) and, on the sm_90a path, the
  // wgmma kernel ("written"), on adjacent lines; each with an f32 gradient, then a bf16 one.
  std::vector<GroupedGemmKernel> row_kernels = {GroupedGemmKernel::mma_128x256};
  if (grouped_gemm_detail::wgmma_available()) row_kernels.push_back(GroupedGemmKernel::wgmma);
  std::vector<std::pair<GroupedGemmKernel, WeightGradOutput>> dw_kernels = {
      {GroupedGemmKernel::mma_128x128, WeightGradOutput::added_to},
      {GroupedGemmKernel::mma_128x128, WeightGradOutput::written}};
  if (grouped_gemm_detail::wgmma_available())
    dw_kernels.push_back({GroupedGemmKernel::wgmma, WeightGradOutput::written});
  std::printf("kernel path: %s; wgmma kernel available here: %s\n", kernel_path().describe().c_str(),
              grouped_gemm_detail::wgmma_available() ? "yes" : "no");
  auto time_kernels = [&](const char* name, double flops, auto&& launch) {
    for (GroupedGemmKernel kernel : row_kernels) {
      const std::string label = std::string(name) + " [" + kernel_name(kernel) + "]";
      print_flop_timing(label.c_str(), median_ms([&](cudaStream_t s) { launch(kernel, s); }, nullptr), flops);
    }
  };
  auto time_weight_grad = [&](const char* name, double flops, auto&& launch) {
    for (const DType c_dtype : {DType::f32, DType::bf16}) {
      for (const auto& [kernel, output] : dw_kernels) {
        const std::string label = std::string(name) + " " + std::string(dtype_name(c_dtype)) +
                                  (output == WeightGradOutput::added_to ? "+= [" : "= [") + kernel_name(kernel) + "]";
        print_flop_timing(label.c_str(),
                          median_ms([&](cudaStream_t s) { launch(kernel, output, c_dtype, s); }, nullptr), flops);
      }
    }
  };
  std::printf(
      "grouped GEMM, T=8192 K=8 E=256 H=2048 I=512 (floor = FLOPs at 790 TFLOP/s; targets (issue 20): "
      ">= 600 TFLOP/s gate_up, >= 480 down, >= 250 dW)\n");
  std::printf("  the forward reads every expert's weights once: gate_up %.2f GB, down %.2f GB of bf16\n",
              2.0 * experts * 2 * inter * hidden * 1e-9, 2.0 * experts * hidden * inter * 1e-9);
  time_kernels("gate_up fwd  [R,H]x[E,2I,H]^T", gu_flops, [&](GroupedGemmKernel kernel, cudaStream_t s) {
    grouped_gemm_rows_cuda_with(kernel, bf16_ptr(x), bf16_ptr(w_gu), true, gu.view.data, DType::bf16, off, experts,
                                rows, 2 * inter, hidden, workspace.data(), workspace.bytes(), s);
  });
  time_kernels("down fwd     [R,I]x[E,H,I]^T", down_flops, [&](GroupedGemmKernel kernel, cudaStream_t s) {
    grouped_gemm_rows_cuda_with(kernel, bf16_ptr(h), bf16_ptr(w_down), true, y.view.data, DType::bf16, off, experts,
                                rows, hidden, inter, workspace.data(), workspace.bytes(), s);
  });
  time_kernels("gate_up dX   [R,2I]x[E,2I,H]", gu_flops, [&](GroupedGemmKernel kernel, cudaStream_t s) {
    grouped_gemm_rows_cuda_with(kernel, bf16_ptr(h), bf16_ptr(w_gu), false, y.view.data, DType::bf16, off, experts,
                                rows, hidden, 2 * inter, workspace.data(), workspace.bytes(), s);
  });
  time_kernels("down dX      [R,H]x[E,H,I] f32", down_flops, [&](GroupedGemmKernel kernel, cudaStream_t s) {
    grouped_gemm_rows_cuda_with(kernel, bf16_ptr(x), bf16_ptr(w_down), false, d_h.view.data, DType::f32, off, experts,
                                rows, inter, hidden, workspace.data(), workspace.bytes(), s);
  });
  // dW "added to" reads and rewrites the f32 gradient c [E, M, N] (2 x 4 bytes per element),
  // "written" only writes it (4 bytes): memory floors beside the FLOP floor (the bf16 operands add
  // ~0.4 GB, mostly from L2); a bf16 gradient halves them. The mma.sync kernel's "written" is a
  // zeroing pass, then the sum.
  const double gu_dw_bytes = 8.0 * experts * 2 * inter * hidden, down_dw_bytes = 8.0 * experts * hidden * inter;
  std::printf("  dW memory floor, added to: gate_up %.2f GB -> %.3f ms, down %.2f GB -> %.3f ms at %.0f GB/s; "
              "written: half\n",
              gu_dw_bytes * 1e-9, gu_dw_bytes / (kMemoryGBpsCeiling * 1e9) * 1e3, down_dw_bytes * 1e-9,
              down_dw_bytes / (kMemoryGBpsCeiling * 1e9) * 1e3, kMemoryGBpsCeiling);
  time_weight_grad("gate_up dW   [R,2I]^T[R,H]", gu_flops,
                   [&](GroupedGemmKernel kernel, WeightGradOutput output, DType c_dtype, cudaStream_t s) {
                     void* c = c_dtype == DType::bf16 ? d_gu_w_bf16.view.data : d_gu_w.view.data;
                     grouped_gemm_weight_grad_cuda_with(kernel, bf16_ptr(h), bf16_ptr(x), c, c_dtype, off, experts,
                                                        2 * inter, hidden, output, s);
                   });
  time_weight_grad("down dW      [R,H]^T[R,I]", down_flops,
                   [&](GroupedGemmKernel kernel, WeightGradOutput output, DType c_dtype, cudaStream_t s) {
                     void* c = c_dtype == DType::bf16 ? d_down_w_bf16.view.data : d_down_w.view.data;
                     grouped_gemm_weight_grad_cuda_with(kernel, bf16_ptr(x), bf16_ptr(h), c, c_dtype, off, experts,
                                                        hidden, inter, output, s);
                   });
  device_synchronize();
}

// The row products and weight gradients that callers get (automatic), at the 35B widths under
// three routings of the 65,536 rows: uniformly random over 256 experts (as Timing35B), balanced
// (256 rows each: no partial tiles) and 8 experts of 8,192 rows (weights reused 64 times: the
// compute-bound rate).
TEST(GroupedGemmGpu, Timing35BRouting) {
  const int64_t rows = 8192 * 8, hidden = 2048, inter = 512;
  DeviceTensor x = to_device(pattern_tensor({rows, hidden}, 1, 1.0f), DType::bf16);
  DeviceTensor h = to_device(pattern_tensor({rows, 2 * inter}, 2, 1.0f), DType::bf16);
  DeviceTensor h_i = to_device(pattern_tensor({rows, inter}, 5, 1.0f), DType::bf16);
  DeviceTensor w_gu = to_device(pattern_tensor({256, 2 * inter, hidden}, 3, 0.02f), DType::bf16);
  DeviceTensor w_down = to_device(pattern_tensor({256, hidden, inter}, 4, 0.02f), DType::bf16);
  DeviceTensor gu = device_tensor(DType::bf16, {rows, 2 * inter});
  DeviceTensor y = device_tensor(DType::bf16, {rows, hidden});
  DeviceTensor d_h = device_tensor(DType::f32, {rows, inter});
  DeviceTensor d_gu_w = device_tensor(DType::f32, {256, 2 * inter, hidden});
  DeviceTensor d_down_w = device_tensor(DType::f32, {256, hidden, inter});
  DeviceTensor d_gu_w_bf16 = device_tensor(DType::bf16, {256, 2 * inter, hidden});
  DeviceTensor d_down_w_bf16 = device_tensor(DType::bf16, {256, hidden, inter});
  for (DeviceTensor* t : {&d_gu_w, &d_down_w, &d_gu_w_bf16, &d_down_w_bf16}) device_fill_bytes(t->view, 0);
  DeviceBuffer workspace(grouped_gemm_rows_workspace_bytes(256));
  DeviceBuffer square_sums(sizeof(double)), squares_scratch(kWeightGradSquaresScratchBytes);
  const double gu_flops = 2.0 * rows * (2 * inter) * hidden, down_flops = 2.0 * rows * hidden * inter;
  struct Routing {
    const char* name;
    std::vector<int32_t> offsets;
  };
  std::vector<int32_t> balanced(257), few(9);
  for (int g = 0; g <= 256; ++g) balanced[g] = static_cast<int32_t>(g * (rows / 256));
  for (int g = 0; g <= 8; ++g) few[g] = static_cast<int32_t>(g * (rows / 8));
  const Routing routings[] = {{"random 256", random_offsets(rows, 256, 0, 77)}, {"balanced 256", balanced},
                              {"8 experts", few}};
  for (const Routing& routing : routings) {
    DeviceTensor off_d = offsets_to_device(routing.offsets);
    const int32_t* off = static_cast<const int32_t*>(off_d.view.data);
    const int64_t experts = static_cast<int64_t>(routing.offsets.size()) - 1;
    auto time = [&](const char* product, double flops, auto&& launch) {
      const std::string label = std::string(product) + " " + routing.name;
      print_flop_timing(label.c_str(), median_ms([&](cudaStream_t s) { launch(s); }, nullptr), flops);
    };
    time("gate_up fwd", gu_flops, [&](cudaStream_t s) {
      grouped_gemm_rows_cuda(bf16_ptr(x), bf16_ptr(w_gu), true, gu.view.data, DType::bf16, off, experts, rows,
                             2 * inter, hidden, workspace.data(), workspace.bytes(), s);
    });
    time("down fwd", down_flops, [&](cudaStream_t s) {
      grouped_gemm_rows_cuda(bf16_ptr(h_i), bf16_ptr(w_down), true, y.view.data, DType::bf16, off, experts, rows,
                             hidden, inter, workspace.data(), workspace.bytes(), s);
    });
    time("gate_up dX", gu_flops, [&](cudaStream_t s) {
      grouped_gemm_rows_cuda(bf16_ptr(h), bf16_ptr(w_gu), false, y.view.data, DType::bf16, off, experts, rows,
                             hidden, 2 * inter, workspace.data(), workspace.bytes(), s);
    });
    time("down dX f32", down_flops, [&](cudaStream_t s) {
      grouped_gemm_rows_cuda(bf16_ptr(x), bf16_ptr(w_down), false, d_h.view.data, DType::f32, off, experts, rows,
                             inter, hidden, workspace.data(), workspace.bytes(), s);
    });
    for (WeightGradOutput output : {WeightGradOutput::added_to, WeightGradOutput::written}) {
      const bool added = output == WeightGradOutput::added_to;
      time(added ? "gate_up dW f32+=" : "gate_up dW f32=", gu_flops, [&](cudaStream_t s) {
        grouped_gemm_weight_grad_cuda(bf16_ptr(h), bf16_ptr(x), d_gu_w.view.data, DType::f32, off, experts, 2 * inter,
                                      hidden, output, s);
      });
      time(added ? "down dW f32+=" : "down dW f32=", down_flops, [&](cudaStream_t s) {
        grouped_gemm_weight_grad_cuda(bf16_ptr(x), bf16_ptr(h_i), d_down_w.view.data, DType::f32, off, experts,
                                      hidden, inter, output, s);
      });
      time(added ? "gate_up dW bf16+=" : "gate_up dW bf16=", gu_flops, [&](cudaStream_t s) {
        grouped_gemm_weight_grad_cuda(bf16_ptr(h), bf16_ptr(x), d_gu_w_bf16.view.data, DType::bf16, off, experts,
                                      2 * inter, hidden, output, s);
      });
      time(added ? "down dW bf16+=" : "down dW bf16=", down_flops, [&](cudaStream_t s) {
        grouped_gemm_weight_grad_cuda(bf16_ptr(x), bf16_ptr(h_i), d_down_w_bf16.view.data, DType::bf16, off, experts,
                                      hidden, inter, output, s);
      });
    }
    // Written with the sum of squares of the gradient divided by 1, by a token count (the form a
    // step of one backward uses) and by a fraction (fp64 quotient).
    for (const auto& [divide, divisor] : {std::pair{"/1", 1.0}, std::pair{"/8191", 8191.0}, std::pair{"/0.37", 0.37}}) {
      const WeightGradSquares squares{static_cast<double*>(square_sums.data()), divisor, squares_scratch.data()};
      const std::string gate_up_label = std::string("gate_up dW f32= squares") + divide;
      const std::string down_label = std::string("down dW f32= squares") + divide;
      time(gate_up_label.c_str(), gu_flops, [&](cudaStream_t s) {
        grouped_gemm_weight_grad_cuda_with(GroupedGemmKernel::automatic, bf16_ptr(h), bf16_ptr(x), d_gu_w.view.data,
                                           DType::f32, off, experts, 2 * inter, hidden, WeightGradOutput::written, s,
                                           &squares);
      });
      time(down_label.c_str(), down_flops, [&](cudaStream_t s) {
        grouped_gemm_weight_grad_cuda_with(GroupedGemmKernel::automatic, bf16_ptr(x), bf16_ptr(h_i),
                                           d_down_w.view.data, DType::f32, off, experts, hidden, inter,
                                           WeightGradOutput::written, s, &squares);
      });
    }
    // The step's form with bf16 gradients: written, squares of the gradient divided by a token count.
    {
      const WeightGradSquares squares{static_cast<double*>(square_sums.data()), 8191.0, squares_scratch.data()};
      time("gate_up dW bf16= squares/8191", gu_flops, [&](cudaStream_t s) {
        grouped_gemm_weight_grad_cuda(bf16_ptr(h), bf16_ptr(x), d_gu_w_bf16.view.data, DType::bf16, off, experts,
                                      2 * inter, hidden, WeightGradOutput::written, s, &squares);
      });
      time("down dW bf16= squares/8191", down_flops, [&](cudaStream_t s) {
        grouped_gemm_weight_grad_cuda(bf16_ptr(x), bf16_ptr(h_i), d_down_w_bf16.view.data, DType::bf16, off, experts,
                                      hidden, inter, WeightGradOutput::written, s, &squares);
      });
    }
  }
  device_synchronize();
}

}  // namespace
}  // namespace deltamoe
