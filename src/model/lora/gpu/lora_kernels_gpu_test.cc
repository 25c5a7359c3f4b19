// GPU LoRA products (kernels/lora/lora_cuda.h) against the CPU reference of the adapter
// (model/lora/lora.h: lora_delta, lora_delta_backward, i.e. what the CPU model's projection funnel
// computes): a dense projection (base GEMM + adapter, forward and every gradient, fp32 and bf16
// outputs, f32 dy split into halves) and the routed experts' grouped adapter products (PEFT 0.21's
// fused layout, ranks 4 / 8 / 16 / 32 as the small N or K of the grouped kernels, an expert without
// rows, rows past the plan untouched); the shared expert kernel with adapters on its four Linears;
// the dense products with LoRA dropout against the CPU model's funnel with the same mask.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "kernels/common/tensor_compare.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/linear/linear.h"
#include "kernels/lora/lora_cuda.h"
#include "kernels/shared_expert/shared_expert.h"
#include "kernels/shared_expert/shared_expert_cuda.h"
#include "model/lora/lora.h"
#include "model/lora/lora_dropout.h"
#include "model/text/projection.h"

namespace deltamoe {
namespace {

// bf16 rounding leaves ~4e-3 relative error per rounded operand (x A^T and dy B are rounded once
// each); a wrong layout, scale or missing term gives an error of order 1.
constexpr double kBound = 2e-2;

HostTensor bf16_exact(Shape shape, uint64_t seed, float scale) {
  return random_normal_tensor(shape, seed, scale).to_dtype(DType::bf16).to_f32();
}
std::vector<double> as_f64(const HostTensor& t) {
  const float* p = t.as<float>();
  return std::vector<double>(p, p + t.numel());
}
HostTensor from_f64(const std::vector<double>& v, Shape shape) {
  std::vector<float> f(v.begin(), v.end());
  return HostTensor::from_f32(f, shape);
}
const __nv_bfloat16* bf16p(const DeviceTensor& t) { return static_cast<const __nv_bfloat16*>(t.view.data); }
float* f32p(const DeviceTensor& t) { return static_cast<float*>(t.view.data); }
// A large bf16 device tensor of small random values (one host block repeated: fast to make).
DeviceTensor tiled_random(int64_t rows, int64_t cols, uint64_t seed) {
  const int64_t count = rows * cols, block = std::min<int64_t>(count, int64_t{1} << 20);
  HostTensor host = random_normal_tensor({block}, seed, 0.05f).to_dtype(DType::bf16);
  DeviceTensor out = device_tensor(DType::bf16, {rows, cols});
  auto* dst = static_cast<uint8_t*>(out.view.data);
  for (int64_t offset = 0; offset < count; offset += block) {
    const int64_t n = std::min(block, count - offset);
    CUDA_CHECK(cudaMemcpy(dst + offset * 2, host.data(), static_cast<size_t>(n) * 2, cudaMemcpyHostToDevice));
  }
  return out;
}

void expect_close(const std::string& name, const DeviceTensor& got, const HostTensor& ref) {
  const CompareResult r = compare_tensors(name, to_host(got.view), ref);
  EXPECT_TRUE(r.all_finite) << name;
  EXPECT_LE(r.rel_l2, kBound) << name;
}

// ---------------- dense ----------------

struct DenseCase {
  int64_t rows, in, out, rank;
  DType out_dtype;
  bool f32_dy;  // dy given in fp32 and passed as bf16 hi + lo halves (the GDN gates' projections)
};

void run_dense(GemmContext& gemm, const DenseCase& c, uint64_t seed) {
  std::printf("dense T=%lld in=%lld out=%lld r=%lld %s%s\n", (long long)c.rows, (long long)c.in, (long long)c.out,
              (long long)c.rank, c.out_dtype == DType::f32 ? "f32" : "bf16", c.f32_dy ? " f32-dy" : "");
  LoraTarget target;
  target.module = "layer.proj";
  target.in_features = c.in;
  target.out_features = c.out;
  const double scaling = 32.0 / static_cast<double>(c.rank);
  HostTensor x = bf16_exact({c.rows, c.in}, seed, 1.0f);
  HostTensor w = bf16_exact({c.out, c.in}, seed + 1, 1.0f / std::sqrt(float(c.in)));
  HostTensor a = bf16_exact({c.rank, c.in}, seed + 2, 1.0f / std::sqrt(float(c.in)));
  HostTensor b = bf16_exact({c.out, c.rank}, seed + 3, 0.05f);  // nonzero (PEFT starts it at 0)
  HostTensor dy_full = random_normal_tensor({c.rows, c.out}, seed + 4, 1.0f);
  HostTensor dy_hi = dy_full.to_dtype(DType::bf16).to_f32();
  HostTensor dy_ref = c.f32_dy ? dy_full : dy_hi;
  // A new buffer: HostTensor copies share theirs, and dy_full is the f32-dy reference.
  HostTensor dy_lo(DType::f32, dy_full.shape());
  for (int64_t i = 0; i < dy_lo.numel(); ++i) dy_lo.as<float>()[i] = dy_full.as<float>()[i] - dy_hi.as<float>()[i];
  dy_lo = dy_lo.to_dtype(DType::bf16).to_f32();
  HostTensor ga0 = random_normal_tensor({c.rank, c.in}, seed + 5, 0.1f);
  HostTensor gb0 = random_normal_tensor({c.out, c.rank}, seed + 6, 0.1f);

  // Reference: the adapted weight W + s B A, its products, and the adapter gradients from dW.
  const std::vector<double> xd = as_f64(x), wd = as_f64(w), ad = as_f64(a), bd = as_f64(b), dyd = as_f64(dy_ref);
  std::vector<double> delta(static_cast<size_t>(c.out * c.in));
  lora_delta<double>(target, c.rank, ad.data(), bd.data(), scaling, delta.data());
  std::vector<double> weff(delta.size());
  for (size_t i = 0; i < weff.size(); ++i) weff[i] = wd[i] + delta[i];
  std::vector<double> y(static_cast<size_t>(c.rows * c.out)), dx(static_cast<size_t>(c.rows * c.in)),
      dw(static_cast<size_t>(c.out * c.in), 0.0);
  for (int64_t t = 0; t < c.rows; ++t)
    for (int64_t o = 0; o < c.out; ++o) {
      double s = 0;
      for (int64_t i = 0; i < c.in; ++i) s += xd[t * c.in + i] * weff[o * c.in + i];
      y[t * c.out + o] = s;
    }
  for (int64_t t = 0; t < c.rows; ++t)
    for (int64_t i = 0; i < c.in; ++i) {
      double s = 0;
      for (int64_t o = 0; o < c.out; ++o) s += dyd[t * c.out + o] * weff[o * c.in + i];
      dx[t * c.in + i] = s;
    }
  for (int64_t t = 0; t < c.rows; ++t)
    for (int64_t o = 0; o < c.out; ++o)
      for (int64_t i = 0; i < c.in; ++i) dw[o * c.in + i] += dyd[t * c.out + o] * xd[t * c.in + i];
  std::vector<double> ga = as_f64(ga0), gb = as_f64(gb0);
  lora_delta_backward<double>(target, c.rank, ad.data(), bd.data(), scaling, dw.data(), ga.data(), gb.data());

  DeviceTensor x_d = to_device(x, DType::bf16), w_d = to_device(w, DType::bf16), a_d = to_device(a, DType::bf16),
               b_d = to_device(b, DType::bf16);
  DeviceTensor hi_d = to_device(dy_hi, DType::bf16), lo_d = to_device(dy_lo, DType::bf16);
  DeviceTensor ga_d = to_device(ga0, DType::f32), gb_d = to_device(gb0, DType::f32);
  DeviceTensor y_d = device_tensor(c.out_dtype, {c.rows, c.out}), dx_d = device_tensor(DType::f32, {c.rows, c.in});
  DeviceTensor xa_d = device_tensor(DType::bf16, {c.rows, c.rank}), dxa_d = device_tensor(DType::bf16, {c.rows, c.rank});
  device_fill_bytes(y_d.view, 0xFF);
  device_fill_bytes(dx_d.view, 0xFF);
  device_fill_bytes(xa_d.view, 0xFF);

  LoraDeviceAdapter adapter;
  adapter.a = bf16p(a_d);
  adapter.b = bf16p(b_d);
  adapter.grad_a = f32p(ga_d);
  adapter.grad_b = f32p(gb_d);
  adapter.rank = c.rank;
  adapter.scaling = static_cast<float>(scaling);
  cudaStream_t stream = nullptr;
  auto* xa = static_cast<__nv_bfloat16*>(xa_d.view.data);
  auto* dxa = static_cast<__nv_bfloat16*>(dxa_d.view.data);
  // The funnel's sequence: base product, adapter added; base dX, adapter's dX added; no base dW (frozen).
  linear_forward_cuda(gemm, bf16p(x_d), bf16p(w_d), y_d.view.data, c.out_dtype, c.rows, c.in, c.out, stream);
  lora_linear_forward_cuda(gemm, bf16p(x_d), adapter, xa, y_d.view.data, c.out_dtype, c.rows, c.in, c.out, stream);
  linear_backward_input_f32_cuda(gemm, bf16p(hi_d), bf16p(w_d), f32p(dx_d), false, c.rows, c.in, c.out, stream);
  if (c.f32_dy) linear_backward_input_f32_cuda(gemm, bf16p(lo_d), bf16p(w_d), f32p(dx_d), true, c.rows, c.in, c.out, stream);
  lora_linear_backward_cuda(gemm, bf16p(x_d), bf16p(hi_d), adapter, xa, false, dxa, dx_d.view.data, DType::f32, c.rows,
                            c.in, c.out, stream);
  if (c.f32_dy) {
    lora_linear_backward_cuda(gemm, bf16p(x_d), bf16p(lo_d), adapter, xa, true, dxa, dx_d.view.data, DType::f32,
                              c.rows, c.in, c.out, stream);
  }
  device_synchronize();
  expect_close("y", y_d, from_f64(y, {c.rows, c.out}));
  expect_close("dx", dx_d, from_f64(dx, {c.rows, c.in}));
  expect_close("lora_A grad", ga_d, from_f64(ga, {c.rank, c.in}));
  expect_close("lora_B grad", gb_d, from_f64(gb, {c.out, c.rank}));

  // A frozen adapter: the same dx, no gradient touched.
  LoraDeviceAdapter frozen = adapter;
  frozen.grad_a = frozen.grad_b = nullptr;
  DeviceTensor dx2 = device_tensor(DType::f32, {c.rows, c.in});
  device_fill_bytes(dx2.view, 0);
  lora_linear_backward_cuda(gemm, bf16p(x_d), bf16p(hi_d), frozen, xa, true, dxa, dx2.view.data, DType::f32, c.rows,
                            c.in, c.out, stream);
  device_synchronize();
  const HostTensor dx2_host = to_host(dx2.view);
  double norm = 0;
  for (int64_t i = 0; i < dx2_host.numel(); ++i) norm += std::fabs(dx2_host.as<float>()[i]);
  EXPECT_GT(norm, 0.0) << "frozen adapter: no input gradient";
}

TEST(LoraKernelsGpu, DenseProjectionMatchesCpuReference) {
  GemmContext gemm;
  uint64_t seed = 100;
  for (const DenseCase& c : std::vector<DenseCase>{{37, 64, 96, 8, DType::bf16, false},
                                                    {37, 64, 96, 8, DType::f32, false},
                                                    {64, 128, 32, 16, DType::f32, true},
                                                    {5, 48, 8, 4, DType::bf16, false},
                                                    {130, 256, 384, 32, DType::bf16, false},
                                                    {1, 64, 64, 8, DType::f32, false},
                                                    // shared_expert_gate: one output, fp32 dy in halves
                                                    {150, 64, 1, 8, DType::f32, true}}) {
    run_dense(gemm, c, seed);
    seed += 10;
  }
}

// ---------------- dense with LoRA dropout ----------------

struct DropoutCase {
  int64_t rows, in, out, rank;
  double p;
  DType out_dtype, dx_dtype;
  bool recompute_xa;
};

// The dense products with LoRA dropout against the CPU model's projection funnel
// (model/text/projection.cc: project_forward / project_backward) in the same training pass's scope:
// the GPU mask comes from the same counters (seed, step, micro-batch, adapter index) through
// lora_dropout_mask.h. Also checks that the mask matters (the result without it is far off).
void run_dense_dropout(GemmContext& gemm, const DropoutCase& c, uint64_t seed) {
  std::printf("dense dropout p=%.2f T=%lld in=%lld out=%lld r=%lld y %s dx %s%s\n", c.p, (long long)c.rows,
              (long long)c.in, (long long)c.out, (long long)c.rank, c.out_dtype == DType::f32 ? "f32" : "bf16",
              c.dx_dtype == DType::f32 ? "f32" : "bf16", c.recompute_xa ? " recompute-xa" : "");
  const uint64_t run_seed = 77, step = 3, micro_batch = 1, adapter_index = 5;
  const float scaling = static_cast<float>(32.0 / static_cast<double>(c.rank));
  HostTensor x = bf16_exact({c.rows, c.in}, seed, 1.0f);
  HostTensor w = bf16_exact({c.out, c.in}, seed + 1, 1.0f / std::sqrt(float(c.in)));
  HostTensor a = bf16_exact({c.rank, c.in}, seed + 2, 1.0f / std::sqrt(float(c.in)));
  HostTensor b = bf16_exact({c.out, c.rank}, seed + 3, 0.05f);
  HostTensor dy = bf16_exact({c.rows, c.out}, seed + 4, 1.0f);
  HostTensor ga0 = random_normal_tensor({c.rank, c.in}, seed + 5, 0.1f);
  HostTensor gb0 = random_normal_tensor({c.out, c.rank}, seed + 6, 0.1f);
  auto values = [](const HostTensor& t) { return std::vector<float>(t.as<float>(), t.as<float>() + t.numel()); };

  // CPU reference: the funnel in a training pass's scope.
  ParamMap params;
  params["layer.proj.weight"] = {{c.out, c.in}, values(w)};
  params["layer.proj.lora_A.weight"] = {{c.rank, c.in}, values(a)};
  params["layer.proj.lora_B.weight"] = {{c.out, c.rank}, values(b)};
  params["layer.proj.lora_scaling"] = {{1}, {scaling}};
  params["layer.proj.lora_index"] = {{1}, {static_cast<float>(adapter_index)}};
  ParamMap grads;
  grads["layer.proj.lora_A.weight"] = {{c.rank, c.in}, values(ga0)};
  grads["layer.proj.lora_B.weight"] = {{c.out, c.rank}, values(gb0)};
  std::vector<float> y_ref(static_cast<size_t>(c.rows * c.out)), dx_ref(static_cast<size_t>(c.rows * c.in));
  std::vector<float> y_plain(y_ref.size());
  project_forward(params, "layer.proj", x.as<float>(), y_plain.data(), c.rows, c.in, c.out);  // no scope: no dropout
  {
    const LoraDropoutScope scope(c.p, run_seed, step, micro_batch);
    project_forward(params, "layer.proj", x.as<float>(), y_ref.data(), c.rows, c.in, c.out);
    project_backward(params, LayerGrads(params, &grads), "layer.proj", x.as<float>(), dy.as<float>(), dx_ref.data(),
                     c.rows, c.in, c.out);
  }

  const LoraDropoutMask mask = lora_dropout_mask(c.p, run_seed, step, micro_batch, adapter_index);
  DeviceTensor x_d = to_device(x, DType::bf16), w_d = to_device(w, DType::bf16), a_d = to_device(a, DType::bf16),
               b_d = to_device(b, DType::bf16), dy_d = to_device(dy, DType::bf16);
  DeviceTensor ga_d = to_device(ga0, DType::f32), gb_d = to_device(gb0, DType::f32);
  DeviceTensor y_d = device_tensor(c.out_dtype, {c.rows, c.out}), dx_d = device_tensor(c.dx_dtype, {c.rows, c.in});
  DeviceTensor xa_d = device_tensor(DType::bf16, {c.rows, c.rank}), dxa_d = device_tensor(DType::bf16, {c.rows, c.rank});
  DeviceBuffer scratch(lora_dropout_scratch_bytes(c.rows, c.in));
  device_fill_bytes(y_d.view, 0xFF);
  device_fill_bytes(xa_d.view, 0xFF);
  LoraDeviceAdapter adapter;
  adapter.a = bf16p(a_d);
  adapter.b = bf16p(b_d);
  adapter.grad_a = f32p(ga_d);
  adapter.grad_b = f32p(gb_d);
  adapter.rank = c.rank;
  adapter.scaling = scaling;
  LoraDropoutPass pass;
  pass.mask = mask;
  pass.scratch = scratch.data();
  pass.scratch_bytes = scratch.bytes();
  cudaStream_t stream = nullptr;
  auto* xa = static_cast<__nv_bfloat16*>(xa_d.view.data);
  auto* dxa = static_cast<__nv_bfloat16*>(dxa_d.view.data);
  linear_forward_cuda(gemm, bf16p(x_d), bf16p(w_d), y_d.view.data, c.out_dtype, c.rows, c.in, c.out, stream);
  lora_linear_forward_cuda(gemm, bf16p(x_d), adapter, xa, y_d.view.data, c.out_dtype, c.rows, c.in, c.out, stream,
                           &pass);
  if (c.recompute_xa) device_fill_bytes(xa_d.view, 0xFF);  // the backward must refill it from x'
  // Base dX: dy W, written (bf16 output through the generic GEMM, f32 through the funnel's).
  gemm_bf16_cuda(gemm, false, false, c.rows, c.in, c.out, 1.0f, bf16p(dy_d), c.out, bf16p(w_d), c.in, 0.0f,
                 dx_d.view.data, c.dx_dtype, c.in, stream);
  lora_linear_backward_cuda(gemm, bf16p(x_d), bf16p(dy_d), adapter, xa, c.recompute_xa, dxa, dx_d.view.data,
                            c.dx_dtype, c.rows, c.in, c.out, stream, &pass);
  device_synchronize();
  expect_close("y (dropout)", y_d, HostTensor::from_f32(y_ref, {c.rows, c.out}));
  expect_close("dx (dropout)", dx_d, HostTensor::from_f32(dx_ref, {c.rows, c.in}));
  expect_close("lora_A grad (dropout)", ga_d, HostTensor::from_f32(grads.at("layer.proj.lora_A.weight").values, {c.rank, c.in}));
  expect_close("lora_B grad (dropout)", gb_d,
               HostTensor::from_f32(grads.at("layer.proj.lora_B.weight").values, {c.out, c.rank}));
  // The mask matters: the adapter's term without it is well outside the bound.
  std::vector<float> base(y_ref.size());
  linear_forward_ref(x.as<float>(), w.as<float>(), base.data(), c.rows, c.in, c.out);
  for (size_t i = 0; i < base.size(); ++i) y_plain[i] -= base[i], y_ref[i] -= base[i];
  const CompareResult off = compare_tensors("adapter term without dropout", HostTensor::from_f32(y_plain, {c.rows, c.out}),
                                            HostTensor::from_f32(y_ref, {c.rows, c.out}));
  EXPECT_GT(off.rel_l2, 5 * kBound) << "dropout changed the adapter's term too little for this check to catch a missing mask";
}

TEST(LoraKernelsGpu, DenseDropoutMatchesCpuFunnel) {
  GemmContext gemm;
  uint64_t seed = 500;
  for (const DropoutCase& c : std::vector<DropoutCase>{{37, 64, 96, 8, 0.1, DType::bf16, DType::f32, false},
                                                       {37, 66, 96, 8, 0.5, DType::f32, DType::f32, true},
                                                       {64, 128, 32, 16, 0.3, DType::f32, DType::bf16, true},
                                                       {130, 256, 384, 32, 0.05, DType::bf16, DType::bf16, false},
                                                       {150, 64, 1, 8, 0.2, DType::f32, DType::f32, true}}) {
    run_dense_dropout(gemm, c, seed);
    seed += 10;
  }
}

// The GPU mask is the CPU one, element for element (the kernel's x' read back against
// lora_dropout_apply_ref on the same bf16 values), over a width that is not a multiple of 4.
TEST(LoraKernelsGpu, DropoutMaskMatchesCpu) {
  const int64_t rows = 301, cols = 1027;
  const LoraDropoutMask mask = lora_dropout_mask(0.3, 9, 12, 4, 17);
  HostTensor x = bf16_exact({rows, cols}, 31, 1.0f);
  DeviceTensor x_d = to_device(x, DType::bf16), out_d = device_tensor(DType::bf16, {rows, cols});
  lora_dropout_apply_cuda(mask, bf16p(x_d), static_cast<__nv_bfloat16*>(out_d.view.data), rows, cols, nullptr);
  device_synchronize();
  const HostTensor got = to_host(out_d.view).to_f32();
  std::vector<float> want(static_cast<size_t>(rows * cols));
  lora_dropout_apply_ref(mask, x.as<float>(), want.data(), rows, cols);
  const HostTensor want_bf16 = HostTensor::from_f32(want, {rows, cols}).to_dtype(DType::bf16).to_f32();
  int64_t mismatches = 0, dropped = 0;
  for (int64_t i = 0; i < rows * cols; ++i) {
    mismatches += got.as<float>()[i] != want_bf16.as<float>()[i];
    dropped += (want[static_cast<size_t>(i)] == 0.0f) && x.as<float>()[i] != 0.0f;
  }
  std::printf("  %lld of %lld dropped, %lld mismatches\n", (long long)dropped, (long long)(rows * cols),
              (long long)mismatches);
  EXPECT_EQ(mismatches, 0);
  EXPECT_NEAR(static_cast<double>(dropped) / (rows * cols), 0.3, 0.01);
}

// ---------------- shared expert ----------------

// The shared expert kernel with adapters on all four of its Linears against the reference shared
// expert run on the adapted weights W + s B A (fp64), the adapters' gradients formed from those
// weights' gradients (lora_delta_backward): y, dx and every dA / dB.
void run_shared_expert(GemmContext& gemm, int64_t T, int64_t C, int64_t I, int64_t rank, uint64_t seed) {
  std::printf("shared expert T=%lld C=%lld I=%lld r=%lld, adapters on gate/up/down_proj and the gate\n", (long long)T,
              (long long)C, (long long)I, (long long)rank);
  struct Linear {
    const char* name = nullptr;
    int64_t in = 0, out = 0;
    HostTensor w, a, b;
    std::vector<double> weff, dw;
    DeviceTensor w_d, a_d, b_d, ga_d, gb_d;
  };
  std::vector<Linear> linears(4);  // gate_proj, up_proj, down_proj, shared_expert_gate
  const char* names[] = {"gate_proj", "up_proj", "down_proj", "shared_expert_gate"};
  const int64_t ins[] = {C, C, I, C}, outs[] = {I, I, C, 1};
  for (size_t k = 0; k < linears.size(); ++k) {
    linears[k].name = names[k];
    linears[k].in = ins[k];
    linears[k].out = outs[k];
  }
  const double scaling = 2.0;
  const HostTensor x = bf16_exact({T, C}, seed, 1.0f);
  const HostTensor dy = bf16_exact({T, C}, seed + 1, 1.0f);
  for (Linear& l : linears) {
    l.w = bf16_exact({l.out, l.in}, ++seed * 7, 1.0f / std::sqrt(float(l.in)));
    l.a = bf16_exact({rank, l.in}, ++seed * 7, 1.0f / std::sqrt(float(l.in)));
    l.b = bf16_exact({l.out, rank}, ++seed * 7, 0.1f);
    LoraTarget target;
    target.module = l.name;
    target.in_features = l.in;
    target.out_features = l.out;
    const std::vector<double> wd = as_f64(l.w), ad = as_f64(l.a), bd = as_f64(l.b);
    l.weff.resize(wd.size());
    lora_delta<double>(target, rank, ad.data(), bd.data(), scaling, l.weff.data());
    for (size_t i = 0; i < wd.size(); ++i) l.weff[i] += wd[i];
    l.dw.assign(wd.size(), 0.0);
  }
  const std::vector<double> xd = as_f64(x), dyd = as_f64(dy);
  std::vector<double> y(static_cast<size_t>(T * C)), dx(static_cast<size_t>(T * C));
  shared_expert_forward_ref<double>(xd.data(), linears[0].weff.data(), linears[1].weff.data(), linears[2].weff.data(),
                                    linears[3].weff.data(), y.data(), T, C, I);
  shared_expert_backward_ref<double>(xd.data(), linears[0].weff.data(), linears[1].weff.data(), linears[2].weff.data(),
                                     linears[3].weff.data(), dyd.data(), dx.data(), linears[0].dw.data(),
                                     linears[1].dw.data(), linears[2].dw.data(), linears[3].dw.data(), T, C, I);

  SharedExpertLora lora;
  lora.gemm = &gemm;
  LoraDeviceAdapter* adapters[] = {&lora.gate_proj, &lora.up_proj, &lora.down_proj, &lora.expert_gate};
  for (size_t k = 0; k < linears.size(); ++k) {
    Linear& l = linears[k];
    l.w_d = to_device(l.w, DType::bf16);
    l.a_d = to_device(l.a, DType::bf16);
    l.b_d = to_device(l.b, DType::bf16);
    l.ga_d = device_tensor(DType::f32, {rank, l.in});
    l.gb_d = device_tensor(DType::f32, {l.out, rank});
    device_fill_bytes(l.ga_d.view, 0);
    device_fill_bytes(l.gb_d.view, 0);
    *adapters[k] = LoraDeviceAdapter{bf16p(l.a_d), bf16p(l.b_d), f32p(l.ga_d), f32p(l.gb_d), rank,
                                     static_cast<float>(scaling)};
  }
  DeviceBuffer scratch(shared_expert_lora_scratch_bytes(T, rank));
  lora.scratch = scratch.data();
  lora.scratch_bytes = scratch.bytes();
  const size_t ws_bytes = std::max(shared_expert_forward_workspace_bytes(T, C, I),
                                   shared_expert_backward_workspace_bytes(T, C, I));
  DeviceBuffer workspace(ws_bytes);
  DeviceTensor x_d = to_device(x, DType::bf16), dy_d = to_device(dy, DType::bf16);
  DeviceTensor y_d = device_tensor(DType::bf16, {T, C}), dx_d = device_tensor(DType::bf16, {T, C});
  device_fill_bytes(y_d.view, 0xFF);
  device_fill_bytes(dx_d.view, 0xFF);
  auto* y_p = static_cast<__nv_bfloat16*>(y_d.view.data);
  auto* dx_p = static_cast<__nv_bfloat16*>(dx_d.view.data);
  // The base frozen: null weight gradients, so only the adapters' products form gradients.
  shared_expert_forward_cuda(gemm, bf16p(x_d), bf16p(linears[0].w_d), bf16p(linears[1].w_d), bf16p(linears[2].w_d),
                             bf16p(linears[3].w_d), y_p, false, T, C, I, workspace.data(), ws_bytes, nullptr, &lora);
  shared_expert_backward_cuda(gemm, bf16p(x_d), bf16p(linears[0].w_d), bf16p(linears[1].w_d), bf16p(linears[2].w_d),
                              bf16p(linears[3].w_d), bf16p(dy_d), dx_p, false, nullptr, nullptr, nullptr, nullptr, T, C,
                              I, workspace.data(), ws_bytes, nullptr, &lora);
  device_synchronize();
  expect_close("shared expert y", y_d, from_f64(y, {T, C}));
  expect_close("shared expert dx", dx_d, from_f64(dx, {T, C}));
  for (Linear& l : linears) {
    LoraTarget target;
    target.module = l.name;
    target.in_features = l.in;
    target.out_features = l.out;
    std::vector<double> ga(static_cast<size_t>(rank * l.in), 0.0), gb(static_cast<size_t>(l.out * rank), 0.0);
    const std::vector<double> ad = as_f64(l.a), bd = as_f64(l.b);
    lora_delta_backward<double>(target, rank, ad.data(), bd.data(), scaling, l.dw.data(), ga.data(), gb.data());
    expect_close(std::string(l.name) + " lora_A grad", l.ga_d, from_f64(ga, {rank, l.in}));
    expect_close(std::string(l.name) + " lora_B grad", l.gb_d, from_f64(gb, {l.out, rank}));
  }
}

TEST(LoraKernelsGpu, SharedExpertAdaptersMatchCpuReference) {
  GemmContext gemm;
  run_shared_expert(gemm, 150, 64, 48, 8, 500);
  run_shared_expert(gemm, 37, 128, 96, 4, 600);
}

// ---------------- experts ----------------

void run_experts(int64_t E, int64_t in, int64_t out, int64_t rank, const std::vector<int32_t>& counts, DType dtype,
                 uint64_t seed) {
  std::printf("experts E=%lld in=%lld out=%lld r=%lld %s\n", (long long)E, (long long)in, (long long)out,
              (long long)rank, dtype == DType::f32 ? "f32" : "bf16");
  std::vector<int32_t> offsets(static_cast<size_t>(E + 1), 0);
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + counts[e];
  const int64_t R = offsets[E], max_rows = R + 7;
  LoraTarget target;
  target.module = "model.layers.0.mlp.experts.gate_up_proj";
  target.experts = true;
  target.num_experts = E;
  target.in_features = in;
  target.out_features = out;
  const double scaling = 16.0 / static_cast<double>(rank);
  HostTensor xp = bf16_exact({max_rows, in}, seed, 1.0f);
  HostTensor a = bf16_exact({rank * E, in}, seed + 1, 1.0f / std::sqrt(float(in)));
  HostTensor b = bf16_exact({out, rank * E}, seed + 2, 0.05f);
  HostTensor dy = bf16_exact({max_rows, out}, seed + 3, 1.0f);
  HostTensor y0 = bf16_exact({max_rows, out}, seed + 4, 1.0f);
  HostTensor dx0 = bf16_exact({max_rows, in}, seed + 5, 1.0f);
  HostTensor ga0 = random_normal_tensor({rank * E, in}, seed + 6, 0.1f);
  HostTensor gb0 = random_normal_tensor({out, rank * E}, seed + 7, 0.1f);

  const std::vector<double> xd = as_f64(xp), ad = as_f64(a), bd = as_f64(b), dyd = as_f64(dy);
  std::vector<double> delta(static_cast<size_t>(E * out * in)), d_delta(delta.size(), 0.0);
  lora_delta<double>(target, rank, ad.data(), bd.data(), scaling, delta.data());
  std::vector<double> y = as_f64(y0), dx = as_f64(dx0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t row = offsets[e]; row < offsets[e + 1]; ++row) {
      const double* de = delta.data() + e * out * in;
      for (int64_t o = 0; o < out; ++o) {
        double s = 0;
        for (int64_t i = 0; i < in; ++i) s += xd[row * in + i] * de[o * in + i];
        y[row * out + o] += s;
      }
      for (int64_t i = 0; i < in; ++i) {
        double s = 0;
        for (int64_t o = 0; o < out; ++o) s += dyd[row * out + o] * de[o * in + i];
        dx[row * in + i] += s;
      }
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) d_delta[(e * out + o) * in + i] += dyd[row * out + o] * xd[row * in + i];
    }
  std::vector<double> ga = as_f64(ga0), gb = as_f64(gb0);
  lora_delta_backward<double>(target, rank, ad.data(), bd.data(), scaling, d_delta.data(), ga.data(), gb.data());

  DeviceTensor xp_d = to_device(xp, DType::bf16), a_d = to_device(a, DType::bf16), b_d = to_device(b, DType::bf16),
               dy_d = to_device(dy, DType::bf16), y_d = to_device(y0, dtype), dx_d = to_device(dx0, dtype),
               ga_d = to_device(ga0, DType::f32), gb_d = to_device(gb0, DType::f32);
  HostTensor off_host(DType::i32, {E + 1});
  for (int64_t e = 0; e <= E; ++e) off_host.as<int32_t>()[e] = offsets[e];
  DeviceTensor off_d = to_device(off_host, DType::i32);
  LoraExpertDims dims{E, in, out, rank, max_rows};
  DeviceBuffer workspace(lora_experts_workspace_bytes(dims));
  LoraDeviceAdapter adapter;
  adapter.a = bf16p(a_d);
  adapter.b = bf16p(b_d);
  adapter.grad_a = f32p(ga_d);
  adapter.grad_b = f32p(gb_d);
  adapter.rank = rank;
  adapter.scaling = static_cast<float>(scaling);
  const auto* off = static_cast<const int32_t*>(off_d.view.data);
  lora_experts_forward_cuda(bf16p(xp_d), adapter, off, y_d.view.data, dtype, dims, workspace.data(), workspace.bytes(),
                            nullptr);
  lora_experts_backward_cuda(bf16p(xp_d), bf16p(dy_d), adapter, off, dx_d.view.data, dtype, dims, workspace.data(),
                             workspace.bytes(), nullptr);
  device_synchronize();
  // y and dx are compared as their adapter terms (base values subtracted), so the bound is not
  // diluted by the untouched inputs; rows past the plan must come back bitwise.
  auto term = [&](const DeviceTensor& got, const HostTensor& base, const std::vector<double>& ref, int64_t width,
                  const std::string& name) {
    HostTensor g = to_host(got.view).to_f32();
    std::vector<double> got_term(static_cast<size_t>(R * width)), ref_term(got_term.size());
    for (int64_t i = 0; i < R * width; ++i) {
      got_term[i] = g.as<float>()[i] - base.as<float>()[i];
      ref_term[i] = ref[i] - base.as<float>()[i];
    }
    const CompareResult r = compare_tensors(name, from_f64(got_term, {R, width}), from_f64(ref_term, {R, width}));
    EXPECT_TRUE(r.all_finite) << name;
    EXPECT_LE(r.rel_l2, dtype == DType::f32 ? kBound : 4 * kBound) << name;  // bf16 output rounds the sum
    for (int64_t i = R * width; i < max_rows * width; ++i) {
      ASSERT_EQ(g.as<float>()[i], base.as<float>()[i]) << name << ": row past the plan written at " << i;
    }
  };
  term(y_d, y0, y, out, "experts y adapter term");
  term(dx_d, dx0, dx, in, "experts dx adapter term");
  expect_close("experts lora_A grad", ga_d, from_f64(ga, {rank * E, in}));
  expect_close("experts lora_B grad", gb_d, from_f64(gb, {out, rank * E}));
}

TEST(LoraKernelsGpu, ExpertAdaptersMatchCpuReference) {
  uint64_t seed = 500;
  for (int64_t rank : {4, 8, 16, 32}) {
    run_experts(4, 64, 96, rank, {13, 0, 40, 9}, DType::f32, seed);
    run_experts(4, 64, 96, rank, {13, 0, 40, 9}, DType::bf16, seed + 20);
    seed += 100;
  }
  // Odd widths (the WMMA path of the grouped kernels) and many experts with few rows each.
  run_experts(3, 40, 24, 8, {1, 7, 3}, DType::f32, 900);
  std::vector<int32_t> counts(64);
  for (int e = 0; e < 64; ++e) counts[e] = (e * 7) % 5;
  run_experts(64, 128, 64, 8, counts, DType::f32, 950);
}

// Timing at the Qwen3.5-35B-A3B shapes of one micro-batch (8,192 tokens, top-8 of 256 experts, rank 8):
// what LoRA adds per layer on top of the frozen base products. Prints; asserts nothing about speed.
TEST(LoraKernelsGpu, TimingAt35bShapes) {
  constexpr int64_t T = 8192, C = 2048, E = 256, K = 8, I = 512, r = 8;
  const int64_t R = T * K;
  cudaStream_t stream = nullptr;
  GemmContext gemm;
  DeviceTensor x = tiled_random(T, C, 1), dy = tiled_random(T, 8192, 2);
  DeviceTensor a = tiled_random(r, C, 3), b = tiled_random(8192, r, 4);
  DeviceTensor ga = device_tensor(DType::f32, {r, C}), gb = device_tensor(DType::f32, {8192, r});
  DeviceTensor y = device_tensor(DType::bf16, {T, 8192}), dx = device_tensor(DType::f32, {T, C});
  DeviceTensor xa = device_tensor(DType::bf16, {T, r}), dxa = device_tensor(DType::bf16, {T, r});
  device_fill_bytes(ga.view, 0);
  device_fill_bytes(gb.view, 0);
  device_fill_bytes(dx.view, 0);
  LoraDeviceAdapter dense{bf16p(a), bf16p(b), f32p(ga), f32p(gb), r, 4.0f};
  auto* xa_p = static_cast<__nv_bfloat16*>(xa.view.data);
  auto* dxa_p = static_cast<__nv_bfloat16*>(dxa.view.data);
  const double dense_ms = median_ms(
      [&](cudaStream_t s) {
        lora_linear_forward_cuda(gemm, bf16p(x), dense, xa_p, y.view.data, DType::bf16, T, C, 8192, s);
        lora_linear_backward_cuda(gemm, bf16p(x), bf16p(dy), dense, xa_p, true, dxa_p, dx.view.data, DType::f32, T, C,
                                  8192, s);
      },
      stream);
  std::printf("  TIMING dense adapter fwd+bwd T=%lld %lldx%lld r=%lld: %.3f ms\n", (long long)T, (long long)C, 8192LL,
              (long long)r, dense_ms);

  // Routed experts: R = T K rows spread evenly (the balanced case).
  HostTensor off_host(DType::i32, {E + 1});
  for (int64_t e = 0; e <= E; ++e) off_host.as<int32_t>()[e] = static_cast<int32_t>(e * (R / E));
  DeviceTensor off = to_device(off_host, DType::i32);
  const auto* off_p = static_cast<const int32_t*>(off.view.data);
  for (const auto& [name, in, out] : std::vector<std::tuple<const char*, int64_t, int64_t>>{
           {"gate_up_proj", C, 2 * I}, {"down_proj", I, C}}) {
    DeviceTensor xp = tiled_random(R, in, 5), dyp = tiled_random(R, out, 6);
    DeviceTensor ea = tiled_random(r * E, in, 7), eb = tiled_random(out, r * E, 8);
    DeviceTensor ega = device_tensor(DType::f32, {r * E, in}), egb = device_tensor(DType::f32, {out, r * E});
    DeviceTensor yp = device_tensor(DType::bf16, {R, out}), dxp = device_tensor(DType::bf16, {R, in});
    device_fill_bytes(ega.view, 0);
    device_fill_bytes(egb.view, 0);
    device_fill_bytes(yp.view, 0);
    device_fill_bytes(dxp.view, 0);
    LoraExpertDims dims{E, in, out, r, R};
    DeviceBuffer workspace(lora_experts_workspace_bytes(dims));
    LoraDeviceAdapter adapter{bf16p(ea), bf16p(eb), f32p(ega), f32p(egb), r, 4.0f};
    const double fwd_ms = median_ms(
        [&](cudaStream_t s) {
          lora_experts_forward_cuda(bf16p(xp), adapter, off_p, yp.view.data, DType::bf16, dims, workspace.data(),
                                    workspace.bytes(), s);
        },
        stream);
    const double bwd_ms = median_ms(
        [&](cudaStream_t s) {
          lora_experts_backward_cuda(bf16p(xp), bf16p(dyp), adapter, off_p, dxp.view.data, DType::bf16, dims,
                                     workspace.data(), workspace.bytes(), s);
        },
        stream);
    std::printf("  TIMING experts %s adapter R=%lld in=%lld out=%lld r=%lld: forward %.3f ms, backward %.3f ms "
                "(workspace %.0f MiB)\n",
                name, (long long)R, (long long)in, (long long)out, (long long)r, fwd_ms, bwd_ms,
                workspace.bytes() / 1048576.0);
  }
  device_synchronize();
}

}  // namespace
}  // namespace deltamoe
