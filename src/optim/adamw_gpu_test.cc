// GPU test of AdamW: the device update equals the CPU reference bit for bit (master weights,
// both moments, f32 and bf16 moments, decay on and off, several steps, the gradient divided by an
// integer or a fractional count and clipped on the fly as the CPU engine does it in place, buffers
// aligned for the kernel's vectors or not), the layout walk over pieces equals AdamW::step with
// per-tensor lr scales, masters kept split (split_master.h), bf16 gradients (the routed experts':
// widened, they give the fp32 form's update), and timing over a large flat buffer with either
// moment type, master form and gradient type.
#include <gtest/gtest.h>

#include <cstring>

#include "core/device_buffer.h"
#include "core/rng.h"
#include "kernels/gemm/gpu_timing.h"
#include "optim/adamw.h"
#include "optim/adamw_cuda.h"
#include "optim/split_master.h"

namespace deltamoe {
namespace {

std::vector<float> random_floats(int64_t count, uint64_t seed, float scale) {
  std::vector<float> values(static_cast<size_t>(count));
  Rng rng(seed);
  for (float& value : values) value = static_cast<float>(rng.normal()) * scale;
  return values;
}

DeviceBuffer upload(const void* data, size_t bytes) {
  DeviceBuffer buffer(bytes);
  CUDA_CHECK(cudaMemcpy(buffer.data(), data, bytes, cudaMemcpyHostToDevice));
  return buffer;
}

std::vector<uint8_t> download(const DeviceBuffer& buffer, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  CUDA_CHECK(cudaMemcpy(out.data(), buffer.data(), bytes, cudaMemcpyDeviceToHost));
  return out;
}

// Counts differing elements of two byte images of `count` elements of element_size bytes.
int64_t count_mismatches(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, int64_t count,
                         size_t element_size) {
  int64_t mismatches = 0;
  for (int64_t i = 0; i < count; ++i)
    mismatches += std::memcmp(a.data() + i * element_size, b.data() + i * element_size, element_size) != 0;
  return mismatches;
}

double max_abs_diff_f32(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, int64_t count) {
  double worst = 0;
  for (int64_t i = 0; i < count; ++i) {
    float x, y;
    std::memcpy(&x, a.data() + i * 4, 4);
    std::memcpy(&y, b.data() + i * 4, 4);
    worst = std::max(worst, static_cast<double>(std::fabs(x - y)));
  }
  return worst;
}

const uint8_t* bytes_of(const std::vector<float>& v) { return reinterpret_cast<const uint8_t*>(v.data()); }

// Where the span starts inside its device buffers, in elements: the kernel takes 4 elements at a
// time where every buffer is aligned for that at the same element, and one at a time elsewhere.
struct SpanShift {
  int master = 0;   // master, gradient and moments
  int weights = 0;  // the bf16 weight copy
};

// split: the master kept as the
// bf16 weights (high halves, at shift.weights) and low halves (at shift.master); joined, it must
// equal the CPU's fp32 master bit for bit. Either way the weights are its high halves.
// bf16_grad: the gradient stored in bf16 (at shift.master); the CPU steps with its widened values.
void check_span(DType moment_dtype, bool decay, int64_t count, uint64_t seed, SpanShift shift = {},
                double divisor = 777.0, bool split = false, bool bf16_grad = false) {
  std::printf("adamw span n=%lld moments %s decay %d, shifted by %d (bf16 weights %d), divisor %g%s%s\n",
              static_cast<long long>(count), std::string(dtype_name(moment_dtype)).c_str(), decay, shift.master,
              shift.weights, divisor, split ? ", split master" : "", bf16_grad ? ", bf16 gradient" : "");
  AdamWConfig config;
  config.moment_dtype = moment_dtype;
  config.weight_decay = 0.1;
  const size_t moment_size = dtype_size(moment_dtype), moment_bytes = static_cast<size_t>(count) * moment_size;
  std::vector<float> master = random_floats(count, seed, 0.05f);
  std::vector<uint8_t> m(moment_bytes, 0), v(moment_bytes, 0);
  // Each buffer holds the span at element shift.master (shift.weights for the bf16 copy).
  auto shifted_upload = [&](const void* data, size_t element_size) {
    DeviceBuffer buffer(static_cast<size_t>(count + shift.master) * element_size);
    CUDA_CHECK(cudaMemcpy(static_cast<uint8_t*>(buffer.data()) + shift.master * element_size, data,
                          static_cast<size_t>(count) * element_size, cudaMemcpyHostToDevice));
    return buffer;
  };
  auto shifted_download = [&](const DeviceBuffer& buffer, size_t element_size, int at) {
    std::vector<uint8_t> out(static_cast<size_t>(count) * element_size);
    CUDA_CHECK(cudaMemcpy(out.data(), static_cast<const uint8_t*>(buffer.data()) + at * element_size, out.size(),
                          cudaMemcpyDeviceToHost));
    return out;
  };
  auto at = [&](DeviceBuffer& buffer, size_t element_size, int elements) {
    return static_cast<void*>(static_cast<uint8_t*>(buffer.data()) + elements * element_size);
  };
  DeviceBuffer master_d = shifted_upload(master.data(), 4), m_d = shifted_upload(m.data(), moment_size);
  DeviceBuffer v_d = shifted_upload(v.data(), moment_size), weights_d(static_cast<size_t>(count + shift.weights) * 2);
  std::vector<uint16_t> highs(static_cast<size_t>(count)), lows(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) split_master(master[static_cast<size_t>(i)], highs[i], lows[i]);
  DeviceBuffer low_d = shifted_upload(lows.data(), 2);
  CUDA_CHECK(cudaMemcpy(static_cast<uint16_t*>(weights_d.data()) + shift.weights, highs.data(),
                        static_cast<size_t>(count) * 2, cudaMemcpyHostToDevice));
  const MasterSpan span = split ? MasterSpan{nullptr, static_cast<__nv_bfloat16*>(at(weights_d, 2, shift.weights)),
                                             static_cast<uint16_t*>(at(low_d, 2, shift.master))}
                                : MasterSpan{static_cast<float*>(at(master_d, 4, shift.master)),
                                             static_cast<__nv_bfloat16*>(at(weights_d, 2, shift.weights)), nullptr};
  for (int step = 1; step <= 4; ++step) {
    // Gradients of widely varying scale, with exact zeros and tiny values mixed in.
    std::vector<float> grad = random_floats(count, seed + 100 * step, step == 3 ? 1e-6f : 1.0f);
    for (int64_t i = 0; i < count; i += 17) grad[static_cast<size_t>(i)] = 0.0f;
    const AdamWStepScalars scalars = adamw_step_scalars(config, 3e-4 * step, step);
    // Steps 2 and 4 divide by a token count and clip, the way the engines prepare the gradient.
    const GradientScaling scaling = step % 2 == 0 ? GradientScaling{divisor, 0.37f} : GradientScaling{};
    std::vector<uint16_t> grad_bf16;
    if (bf16_grad) {
      for (float& g : grad) {
        grad_bf16.push_back(float_to_bf16_bits(g));
        g = bf16_bits_to_float(grad_bf16.back());
      }
    }
    DeviceBuffer grad_d = bf16_grad ? shifted_upload(grad_bf16.data(), 2) : shifted_upload(grad.data(), 4);
    for (float& g : grad) {
      if (scaling.divisor != 1.0) g = static_cast<float>(static_cast<double>(g) / scaling.divisor);
      if (scaling.clip_coef < 1.0f) g *= scaling.clip_coef;
    }
    adamw_update_span(scalars, decay, moment_dtype, count, master.data(), grad.data(), m.data(), v.data());
    const GradientSpan grad_span = bf16_grad ? GradientSpan{at(grad_d, 2, shift.master), DType::bf16}
                                             : GradientSpan{at(grad_d, 4, shift.master), DType::f32};
    adamw_update_span_cuda(scalars, decay, moment_dtype, count, span, grad_span, scaling,
                           at(m_d, moment_size, shift.master), at(v_d, moment_size, shift.master), nullptr);
    device_synchronize();
  }
  std::vector<uint8_t> master_got = shifted_download(master_d, 4, shift.master);
  const std::vector<uint8_t> weights_got = shifted_download(weights_d, 2, shift.weights);
  if (split) {  // join the halves
    const std::vector<uint8_t> low_got = shifted_download(low_d, 2, shift.master);
    for (int64_t i = 0; i < count; ++i) {
      uint16_t high, low;
      std::memcpy(&high, weights_got.data() + i * 2, 2);
      std::memcpy(&low, low_got.data() + i * 2, 2);
      const float joined = join_split_master_float(high, low);
      std::memcpy(master_got.data() + i * 4, &joined, 4);
    }
  }
  const std::vector<uint8_t> master_ref(bytes_of(master), bytes_of(master) + count * 4);
  const int64_t master_mismatch = count_mismatches(master_got, master_ref, count, 4);
  const int64_t m_mismatch = count_mismatches(shifted_download(m_d, moment_size, shift.master), m, count, moment_size);
  const int64_t v_mismatch = count_mismatches(shifted_download(v_d, moment_size, shift.master), v, count, moment_size);
  // The bf16 weight is the master's high half (ties away from zero) in both forms.
  std::vector<uint8_t> weights_ref(static_cast<size_t>(count) * 2);
  for (int64_t i = 0; i < count; ++i) {
    uint16_t high, low;
    split_master(master[static_cast<size_t>(i)], high, low);
    std::memcpy(weights_ref.data() + i * 2, &high, 2);
  }
  const int64_t weights_mismatch = count_mismatches(weights_got, weights_ref, count, 2);
  std::printf("  after 4 steps: master max|diff| %.3e, mismatching elements: master %lld, m %lld, v %lld, "
              "bf16 weights %lld (of %lld)\n",
              max_abs_diff_f32(master_got, master_ref, count), static_cast<long long>(master_mismatch),
              static_cast<long long>(m_mismatch), static_cast<long long>(v_mismatch),
              static_cast<long long>(weights_mismatch), static_cast<long long>(count));
  EXPECT_EQ(master_mismatch, 0);
  EXPECT_EQ(m_mismatch, 0);
  EXPECT_EQ(v_mismatch, 0);
  EXPECT_EQ(weights_mismatch, 0);
}

TEST(AdamWGpu, SpanMatchesCpuBitForBit) {
  check_span(DType::f32, true, 100003, 1);
  check_span(DType::f32, false, 1, 2);
  check_span(DType::bf16, true, 65537, 3);
  check_span(DType::bf16, false, 999, 4);
}

// A fractional divisor takes the fp64 quotient; an integer one at or above 2^24 too.
TEST(AdamWGpu, SpanMatchesCpuWithFractionalAndHugeDivisors) {
  check_span(DType::bf16, true, 4099, 5, {}, 777.5);
  check_span(DType::f32, true, 4099, 6, {}, 16777216.0 * 3);
}

// Spans that start off the vectors' alignment: a head taken one at a time, buffers whose
// alignments disagree (the bf16 weights alone: vectors with the weights stored one by one; master
// against the rest: all one at a time), and spans shorter than one vector.
TEST(AdamWGpu, MisalignedSpansMatchCpuBitForBit) {
  for (const DType moment_dtype : {DType::f32, DType::bf16}) {
    check_span(moment_dtype, true, 10007, 7, {1, 1});
    check_span(moment_dtype, true, 10007, 8, {3, 3});
    check_span(moment_dtype, false, 10007, 9, {0, 1});
    check_span(moment_dtype, true, 10007, 10, {2, 0});
    check_span(moment_dtype, true, 10007, 13, {0, 3});
    check_span(moment_dtype, true, 3, 11, {1, 1});
    check_span(moment_dtype, true, 6, 12, {2, 2});
  }
}

// Masters kept split (the one-GPU engine's routed experts): aligned and shifted spans, both moment
// types.
TEST(AdamWGpu, SplitMastersMatchCpuBitForBit) {
  for (DType moments : {DType::bf16, DType::f32}) {
    check_span(moments, true, 100003, 81, {}, 777.0, true);
    check_span(moments, false, 10007, 82, {1, 1}, 8192.0, true);
    check_span(moments, true, 10007, 83, {2, 3}, 777.5, true);  // halves misaligned against each other
    check_span(moments, true, 3, 84, {3, 3}, 777.0, true);
  }
}

// bf16 gradients (the routed experts'), with split and fp32 masters, aligned, shifted (a head one at
// a time) and shorter than a vector.
TEST(AdamWGpu, Bf16GradientsMatchCpuBitForBit) {
  for (DType moments : {DType::bf16, DType::f32}) {
    check_span(moments, true, 100003, 91, {}, 777.0, true, true);
    check_span(moments, false, 10007, 92, {1, 1}, 8192.0, true, true);
    check_span(moments, true, 10007, 93, {2, 3}, 777.5, true, true);
    check_span(moments, true, 10007, 94, {3, 1}, 777.0, false, true);
    check_span(moments, true, 3, 95, {1, 1}, 777.0, true, true);
  }
}

TEST(AdamWGpu, LayoutWalkMatchesAdamWStepOverPieces) {
  ParamLayout layout;
  layout.add_piece("embed", {37, 19}, 100, 500);
  layout.add("norm", {19});
  const int vit = layout.add("visual.proj", {23, 11});
  layout.add_piece("bias", {5}, 0, 3);
  layout.set_lr_scale(vit, 0.1);
  for (DType moment_dtype : {DType::f32, DType::bf16}) {
    AdamWConfig config;
    config.moment_dtype = moment_dtype;
    const int64_t n = layout.total_numel();
    std::printf("adamw layout walk: %d pieces, %lld elements, moments %s\n", layout.num_tensors(),
                static_cast<long long>(n), std::string(dtype_name(moment_dtype)).c_str());
    AdamW cpu(layout, config);
    // Padding elements hold random values too: the bitwise comparison checks both sides leave them alone.
    std::vector<float> master = random_floats(n, 11, 0.1f);
    const size_t moment_bytes = static_cast<size_t>(n) * dtype_size(moment_dtype);
    DeviceBuffer master_d = upload(master.data(), n * 4);
    std::vector<uint8_t> zeros(moment_bytes, 0);
    DeviceBuffer m_d = upload(zeros.data(), moment_bytes), v_d = upload(zeros.data(), moment_bytes);
    for (int step = 1; step <= 3; ++step) {
      const std::vector<float> grad = random_floats(n, 20 + step, 0.5f);
      const double lr = 1e-3 / step;
      cpu.step(lr, master.data(), grad.data());
      DeviceBuffer grad_d = upload(grad.data(), n * 4);
      adamw_step_cuda(layout, config, lr, step, GradientScaling{},
                      flat_master_spans(layout, master_d.as<float>(),
                                        std::vector<__nv_bfloat16*>(layout.num_tensors(), nullptr)),
                      flat_gradient_spans(layout, grad_d.as<float>()), m_d.data(), v_d.data(), nullptr);
    }
    device_synchronize();
    const std::vector<uint8_t> master_ref(bytes_of(master), bytes_of(master) + n * 4);
    const int64_t master_mismatch = count_mismatches(download(master_d, n * 4), master_ref, n, 4);
    const int64_t m_mismatch =
        count_mismatches(download(m_d, moment_bytes), cpu.exp_avg_bytes(), n, dtype_size(moment_dtype));
    const int64_t v_mismatch =
        count_mismatches(download(v_d, moment_bytes), cpu.exp_avg_sq_bytes(), n, dtype_size(moment_dtype));
    std::printf("  mismatching elements after 3 steps: master %lld, m %lld, v %lld (of %lld)\n",
                static_cast<long long>(master_mismatch), static_cast<long long>(m_mismatch),
                static_cast<long long>(v_mismatch), static_cast<long long>(n));
    EXPECT_EQ(master_mismatch, 0);
    EXPECT_EQ(m_mismatch, 0);
    EXPECT_EQ(v_mismatch, 0);
  }
}

// A plan over pieces of every kind (fp32 masters with fp32 gradients, split masters with bf16 and
// fp32 gradients, decay off, a learning-rate multiplier), with every small piece in its kind's
// shared launch and, with a low own-launch threshold, the larger ones alone: bit for bit the CPU
// update of each piece.
TEST(AdamWGpu, PlanOverPiecesOfEveryKindMatchesCpuBitForBit) {
  struct Piece {
    const char* name;
    int64_t numel;
    bool split, bf16_grad, decay;
    double lr_scale;
  };
  const std::vector<Piece> pieces = {{"experts.gate_up", 3000, true, true, true, 1.0}, {"norm", 37, false, false, false, 1.0},
                                     {"proj", 2100, false, false, true, 0.5},       {"experts.down", 1500, true, true, true, 1.0},
                                     {"bias", 5, false, false, false, 1.0},         {"split_f32_grad", 700, true, false, true, 1.0},
                                     {"embed", 5000, false, false, true, 1.0}};
  ParamLayout layout;
  for (const Piece& p : pieces) {
    const int index = layout.add(p.name, {p.numel}, p.decay);
    if (p.lr_scale != 1.0) layout.set_lr_scale(index, p.lr_scale);
  }
  const int64_t n = layout.total_numel();
  for (const int32_t own_launch_blocks : {AdamWLaunchPlan::kGridBlocks, 3}) {
    for (const DType moment_dtype : {DType::bf16, DType::f32}) {
      AdamWConfig config;
      config.moment_dtype = moment_dtype;
      std::vector<float> master = random_floats(n, 31, 0.05f);
      std::vector<uint16_t> highs(static_cast<size_t>(n)), lows(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) split_master(master[static_cast<size_t>(i)], highs[i], lows[i]);
      // A split piece's master is what its halves join to.
      for (int i = 0; i < layout.num_tensors(); ++i) {
        if (!pieces[static_cast<size_t>(i)].split) continue;
        for (int64_t e = layout.entry(i).offset; e < layout.entry(i).offset + layout.entry(i).numel; ++e)
          master[static_cast<size_t>(e)] = join_split_master_float(highs[e], lows[e]);
      }
      const size_t moment_size = dtype_size(moment_dtype), moment_bytes = static_cast<size_t>(n) * moment_size;
      std::vector<uint8_t> m(moment_bytes, 0), v(moment_bytes, 0);
      DeviceBuffer master_d = upload(master.data(), n * 4), high_d = upload(highs.data(), n * 2);
      DeviceBuffer low_d = upload(lows.data(), n * 2), m_d = upload(m.data(), moment_bytes);
      DeviceBuffer v_d = upload(v.data(), moment_bytes), grad_d(static_cast<size_t>(n) * 4),
                   grad_bf16_d(static_cast<size_t>(n) * 2);
      std::vector<MasterSpan> masters;
      std::vector<GradientSpan> grads;
      for (int i = 0; i < layout.num_tensors(); ++i) {
        const Piece& p = pieces[static_cast<size_t>(i)];
        const int64_t at = layout.entry(i).offset;
        masters.push_back(p.split ? MasterSpan{nullptr, high_d.as<__nv_bfloat16>() + at, low_d.as<uint16_t>() + at}
                                  : MasterSpan{master_d.as<float>() + at, high_d.as<__nv_bfloat16>() + at, nullptr});
        grads.push_back(p.bf16_grad ? GradientSpan{grad_bf16_d.as<__nv_bfloat16>() + at, DType::bf16}
                                    : GradientSpan{grad_d.as<float>() + at, DType::f32});
      }
      const AdamWLaunchPlan plan(layout, moment_dtype, masters, grads, m_d.data(), v_d.data(), own_launch_blocks);
      // Default threshold: the two kinds with small pieces and the split pieces with fp32 gradients,
      // one launch each; threshold 3 blocks (pieces over 2,048 elements): gate_up, proj and embed alone.
      EXPECT_EQ(plan.num_launches(), own_launch_blocks == 3 ? 6 : 3);
      for (int step = 1; step <= 3; ++step) {
        std::vector<float> grad = random_floats(n, 40 + step, 0.5f);
        std::vector<uint16_t> grad_bf16(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
          grad_bf16[static_cast<size_t>(i)] = float_to_bf16_bits(grad[static_cast<size_t>(i)]);
          for (int p = 0; p < layout.num_tensors(); ++p) {
            const ParamEntry& e = layout.entry(p);
            if (pieces[static_cast<size_t>(p)].bf16_grad && i >= e.offset && i < e.offset + e.numel)
              grad[static_cast<size_t>(i)] = bf16_bits_to_float(grad_bf16[static_cast<size_t>(i)]);
          }
        }
        CUDA_CHECK(cudaMemcpy(grad_d.data(), grad.data(), static_cast<size_t>(n) * 4, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(grad_bf16_d.data(), grad_bf16.data(), static_cast<size_t>(n) * 2, cudaMemcpyHostToDevice));
        const GradientScaling scaling = step == 2 ? GradientScaling{777.0, 0.37f} : GradientScaling{};
        const double lr = 1e-3 / step;
        plan.step(config, lr, step, scaling, nullptr);
        for (float& g : grad) {
          if (scaling.divisor != 1.0) g = static_cast<float>(static_cast<double>(g) / scaling.divisor);
          if (scaling.clip_coef < 1.0f) g *= scaling.clip_coef;
        }
        for (int p = 0; p < layout.num_tensors(); ++p) {
          const ParamEntry& e = layout.entry(p);
          const size_t at = static_cast<size_t>(e.offset);
          adamw_update_span(adamw_step_scalars(config, lr * e.lr_scale, step), e.decay, moment_dtype, e.numel,
                            master.data() + at, grad.data() + at, m.data() + at * moment_size,
                            v.data() + at * moment_size);
        }
      }
      device_synchronize();
      std::vector<uint8_t> master_got = download(master_d, n * 4);
      const std::vector<uint8_t> high_got = download(high_d, n * 2), low_got = download(low_d, n * 2);
      int64_t weight_mismatch = 0;
      for (int p = 0; p < layout.num_tensors(); ++p) {
        const ParamEntry& e = layout.entry(p);
        for (int64_t i = e.offset; i < e.offset + e.numel; ++i) {
          uint16_t high, low, ref_high, ref_low;
          std::memcpy(&high, high_got.data() + i * 2, 2);
          std::memcpy(&low, low_got.data() + i * 2, 2);
          split_master(master[static_cast<size_t>(i)], ref_high, ref_low);
          weight_mismatch += high != ref_high;
          if (!pieces[static_cast<size_t>(p)].split) continue;
          const float joined = join_split_master_float(high, low);
          std::memcpy(master_got.data() + i * 4, &joined, 4);
        }
      }
      const std::vector<uint8_t> master_ref(bytes_of(master), bytes_of(master) + n * 4);
      const int64_t master_mismatch = count_mismatches(master_got, master_ref, n, 4);
      const int64_t m_mismatch = count_mismatches(download(m_d, moment_bytes), m, n, moment_size);
      const int64_t v_mismatch = count_mismatches(download(v_d, moment_bytes), v, n, moment_size);
      std::printf("adamw plan, %d launches (own-launch threshold %d blocks), moments %s: mismatching elements "
                  "after 3 steps: master %lld, m %lld, v %lld, bf16 weights %lld (of %lld)\n",
                  plan.num_launches(), own_launch_blocks, std::string(dtype_name(moment_dtype)).c_str(),
                  static_cast<long long>(master_mismatch), static_cast<long long>(m_mismatch),
                  static_cast<long long>(v_mismatch), static_cast<long long>(weight_mismatch),
                  static_cast<long long>(n));
      EXPECT_EQ(master_mismatch, 0);
      EXPECT_EQ(m_mismatch, 0);
      EXPECT_EQ(v_mismatch, 0);
      EXPECT_EQ(weight_mismatch, 0);
    }
  }
}

TEST(AdamWGpu, BadArgumentsAreRejected) {
  ParamLayout layout;
  layout.add("w", {4, 4});
  AdamWConfig config;
  DeviceBuffer buffer(1024);
  const MasterSpan f32_master{buffer.as<float>(), nullptr, nullptr};
  const GradientSpan grad{buffer.data(), DType::f32};
  EXPECT_THROW(adamw_step_cuda(layout, config, 1e-3, 1, GradientScaling{}, {}, {grad}, buffer.data(), buffer.data(),
                               nullptr),
               Error);
  EXPECT_THROW(adamw_update_span_cuda(adamw_step_scalars(config, 1e-3, 1), true, DType::f32, 4, f32_master,
                                      GradientSpan{buffer.data(), DType::f16}, GradientScaling{}, buffer.data(),
                                      buffer.data(), nullptr),
               Error);
  EXPECT_THROW(adamw_update_span_cuda(adamw_step_scalars(config, 1e-3, 1), true, DType::f16, 4, f32_master,
                                      grad, GradientScaling{}, buffer.data(), buffer.data(), nullptr),
               Error);
  EXPECT_THROW(adamw_update_span_cuda(adamw_step_scalars(config, 1e-3, 1), true, DType::f32, 4, f32_master,
                                      grad, GradientScaling{0.0, 1.0f}, buffer.data(), buffer.data(),
                                      nullptr),
               Error);
  // A master both fp32 and split, and a split one without its high halves.
  EXPECT_THROW(adamw_update_span_cuda(adamw_step_scalars(config, 1e-3, 1), true, DType::f32, 4,
                                      MasterSpan{buffer.as<float>(), nullptr, buffer.as<uint16_t>()},
                                      grad, GradientScaling{}, buffer.data(), buffer.data(), nullptr),
               Error);
  EXPECT_THROW(adamw_update_span_cuda(adamw_step_scalars(config, 1e-3, 1), true, DType::f32, 4,
                                      MasterSpan{nullptr, nullptr, buffer.as<uint16_t>()}, grad,
                                      GradientScaling{}, buffer.data(), buffer.data(), nullptr),
               Error);
}

TEST(AdamWGpu, TimingOverAFlatBuffer) {
  const int64_t count = int64_t{256} << 20;  // 268M parameters (a ZeRO shard of the 35B model is ~4.4B at 8 ranks)
  const std::vector<float> host = random_floats(1 << 20, 5, 0.1f);
  DeviceBuffer master(count * 4), grad(count * 4), m(count * 4), v(count * 4), weights(count * 2);
  DeviceBuffer grad_bf16(count * 2);
  std::vector<uint16_t> host_bf16(host.size());
  for (size_t i = 0; i < host.size(); ++i) host_bf16[i] = float_to_bf16_bits(host[i]);
  for (int64_t offset = 0; offset < count; offset += 1 << 20) {
    for (DeviceBuffer* buffer : {&master, &grad, &m})
      CUDA_CHECK(cudaMemcpy(buffer->as<float>() + offset, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(grad_bf16.as<uint16_t>() + offset, host_bf16.data(), host_bf16.size() * 2,
                          cudaMemcpyHostToDevice));
  }
  AdamWConfig config;
  const AdamWStepScalars scalars = adamw_step_scalars(config, 1e-4, 10);
  CUDA_CHECK(cudaMemset(weights.data(), 0x3c, count * 2));  // bf16 0x3c3c, ~0.0115: a split master's high halves
  // Forms: fp32 master with fp32 or bf16 moments; split master with bf16 moments and an fp32 or a
  // bf16 gradient (the routed experts').
  for (const int form : {0, 1, 2, 3}) {
    const bool split = form >= 2, bf16_grad = form == 3;
    const DType moment_dtype = form == 0 ? DType::f32 : DType::bf16;
    CUDA_CHECK(cudaMemset(v.data(), 0, count * 4));  // a valid (non-negative) second moment
    // Split: the low halves in the first half of the master buffer (random bits from its floats).
    const MasterSpan span = split ? MasterSpan{nullptr, weights.as<__nv_bfloat16>(), master.as<uint16_t>()}
                                  : MasterSpan{master.as<float>(), weights.as<__nv_bfloat16>(), nullptr};
    const double ms = median_ms([&](cudaStream_t s) {
      // A bf16 gradient holds the same values rounded: random bits (the fp32 buffer's bytes read as
      // bf16) include NaNs, infinities and subnormals, whose division and root take slow paths.
      adamw_update_span_cuda(scalars, true, moment_dtype, count, span,
                             bf16_grad ? GradientSpan{grad_bf16.data(), DType::bf16} : GradientSpan{grad.data(), DType::f32},
                             GradientScaling{8192.0, 0.5f}, m.data(), v.data(), s);
    }, nullptr);
    // Read master, grad, m, v; write master, m, v, bf16 weights: 30 B with fp32 moments, 22 with
    // bf16; a split master reads and writes its two halves: 20 B; 18 with a bf16 gradient.
    const double bytes = (form == 0 ? 30.0 : form == 1 ? 22.0 : form == 2 ? 20.0 : 18.0) * count;
    print_bandwidth_timing(form == 0   ? "adamw f32 moments, 268M params"
                           : form == 1 ? "adamw bf16 moments, 268M params"
                           : form == 2 ? "adamw bf16 moments, split master, 268M params"
                                       : "adamw bf16 moments, split master, bf16 gradient, 268M params",
                           ms, bytes);
  }
  // The ceiling beside it: device copies of the split form's bytes (10 read and 10 written a
  // parameter) through the runtime's own copy kernels.
  const double copy_ms = median_ms([&](cudaStream_t s) {
    CUDA_CHECK(cudaMemcpyAsync(master.data(), grad.data(), count * 4, cudaMemcpyDeviceToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(v.data(), m.data(), count * 4, cudaMemcpyDeviceToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(grad.data(), weights.data(), count * 2, cudaMemcpyDeviceToDevice, s));
  }, nullptr);
  print_bandwidth_timing("device copy of the same 20 B a parameter, 268M params", copy_ms, 20.0 * count);
}

}  // namespace
}  // namespace deltamoe
