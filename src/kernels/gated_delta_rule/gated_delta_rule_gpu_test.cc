// GPU test of the chunked gated delta rule kernels (forward and backward) against both CPU
// references (chunked and recurrent) on the same bf16-rounded inputs: packed 1/63/64/65/130-token
// sequences, odd head dims, initial/final states, many short sequences (up to 1,024 in 8,192
// tokens), T=1, an empty sequence, and the Qwen3.5-35B head shape at T = 2 x 4096 (checked on one
// key head's slice) with whole and per-stage timing; in every case the backward after a kept
// forward workspace gives the recomputing backward's bits. (Every kernel's shared tiles fit sm_80's
// 163 KB by static_assert; the compute_80 bundle runs this test on the sm_80 path.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/gated_delta_rule/gated_delta_rule.h"
#include "kernels/gated_delta_rule/gated_delta_rule_cuda.h"
#include "kernels/gated_delta_rule/gdn_gpu_test_util.h"
#include "testing/bit_fingerprint.h"

namespace deltamoe {
namespace {

using namespace gdn_gpu_test;

// bf16 outputs (o, dq, dk, dv): ~3 significant digits, so 1e-2 relative L2.
constexpr double kBf16Tolerance = 1e-2;
// fp32 outputs (states, dg, dbeta): the kernels' products take bf16 operands (W, U / V_new, P, A,
// the boundary states, dV_new), so these carry about one bf16 rounding (gated_delta_rule_notes.md,
// "bf16 intermediates": 1-3.5e-3 on these cases), and dg and dbeta are sums of terms that cancel.
constexpr double kF32Tolerance = 5e-3;

struct GdnCase {
  std::vector<int> lengths;
  int key_heads, value_heads, key_dim, value_dim;
  bool with_states;  // random initial state and d_final_state; checks final/d_initial states
  int check_key_head = -1;  // >= 0: compare only this key head and its value heads (big shapes)
  bool time_it = false;
};

// Host copy of heads [h0, h0 + count) of a [T, H, D] tensor (or [T, H] with dim 1).
HostTensor head_slice(const HostTensor& full, int h0, int count) {
  const Shape& shape = full.shape();
  const int64_t tokens = shape[0], heads = shape[1];
  const int64_t dim = shape.rank() == 3 ? shape[2] : 1;
  Shape out_shape = shape.rank() == 3 ? Shape{tokens, count, dim} : Shape{tokens, count};
  HostTensor out(DType::f32, out_shape);
  const float* src = full.as<float>();
  float* dst = out.as<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int h = 0; h < count; ++h) {
      for (int64_t d = 0; d < dim; ++d) {
        dst[(t * count + h) * dim + d] = src[(t * heads + h0 + h) * dim + d];
      }
    }
  }
  return out;
}

// Same for a state tensor [N, H, Dk, Dv].
HostTensor state_slice(const HostTensor& full, int h0, int count) {
  const Shape& shape = full.shape();
  const int64_t seqs = shape[0], heads = shape[1], block = shape[2] * shape[3];
  HostTensor out(DType::f32, Shape{seqs, count, shape[2], shape[3]});
  for (int64_t n = 0; n < seqs; ++n) {
    for (int h = 0; h < count; ++h) {
      const float* src = full.as<float>() + (n * heads + h0 + h) * block;
      std::copy(src, src + block, out.as<float>() + (n * count + h) * block);
    }
  }
  return out;
}

// Unit-norm rows of a [.., D] tensor (q and k enter the op l2-normalised), then bf16-rounded.
HostTensor unit_rows_bf16(HostTensor x, int dim) {
  float* p = x.as<float>();
  for (int64_t r = 0; r * dim < x.numel(); ++r) {
    double sum_sq = 0;
    for (int d = 0; d < dim; ++d) sum_sq += static_cast<double>(p[r * dim + d]) * p[r * dim + d];
    const double inv = 1.0 / std::sqrt(sum_sq);
    for (int d = 0; d < dim; ++d) p[r * dim + d] = static_cast<float>(p[r * dim + d] * inv);
  }
  return bf16_rounded(x);
}

// Approximate matmul FLOPs of the chunked forward (per chunk and head: K K^T, Q K^T, W, U,
// V_new = U - W H, the inter and intra outputs and the state update).
double forward_flops(const GdnCase& c, int64_t tokens) {
  const double C = kGatedDeltaRuleChunkSize, dk = c.key_dim, dv = c.value_dim;
  const double per_chunk = 2 * 2 * C * C * dk + 2 * C * C * (dk + dv) + 3 * 2 * C * dk * dv +
                           2 * C * C * dv;
  return per_chunk * (static_cast<double>(tokens) / C) * c.value_heads;
}

struct Outputs {
  HostTensor o, final_state, dq, dk, dv, dg, dbeta, d_initial_state;
};

// Runs one CPU reference form (chunked or recurrent) on the host inputs of a (sliced) shape.
Outputs run_reference(bool chunked, const GatedDeltaRuleShape& shape, float scale,
                      const HostTensor& q, const HostTensor& k, const HostTensor& v,
                      const HostTensor& g, const HostTensor& beta, const HostTensor* h0,
                      const HostTensor& d_o, const HostTensor* dh_final) {
  const int64_t T = shape.num_tokens;
  const int N = shape.num_seqs, Hk = shape.num_key_heads, Hv = shape.num_value_heads;
  const int Dk = shape.key_dim, Dv = shape.value_dim;
  Outputs r;
  r.o = HostTensor(DType::f32, Shape{T, Hv, Dv});
  r.final_state = HostTensor(DType::f32, Shape{N, Hv, Dk, Dv});
  r.dq = HostTensor(DType::f32, Shape{T, Hk, Dk});
  r.dk = HostTensor(DType::f32, Shape{T, Hk, Dk});
  r.dv = HostTensor(DType::f32, Shape{T, Hv, Dv});
  r.dg = HostTensor(DType::f32, Shape{T, Hv});
  r.dbeta = HostTensor(DType::f32, Shape{T, Hv});
  r.d_initial_state = HostTensor(DType::f32, Shape{N, Hv, Dk, Dv});
  const float* init = h0 != nullptr ? h0->as<float>() : nullptr;
  const float* d_final = dh_final != nullptr ? dh_final->as<float>() : nullptr;
  if (chunked) {
    gated_delta_rule_chunked_forward_ref(shape, scale, q.as<float>(), k.as<float>(),
                                         v.as<float>(), g.as<float>(), beta.as<float>(), init,
                                         r.o.as<float>(), r.final_state.as<float>());
    gated_delta_rule_chunked_backward_ref(
        shape, scale, q.as<float>(), k.as<float>(), v.as<float>(), g.as<float>(),
        beta.as<float>(), init, d_o.as<float>(), d_final, r.dq.as<float>(), r.dk.as<float>(),
        r.dv.as<float>(), r.dg.as<float>(), r.dbeta.as<float>(), r.d_initial_state.as<float>());
  } else {
    gated_delta_rule_recurrent_forward_ref(shape, scale, q.as<float>(), k.as<float>(),
                                           v.as<float>(), g.as<float>(), beta.as<float>(), init,
                                           r.o.as<float>(), r.final_state.as<float>());
    gated_delta_rule_recurrent_backward_ref(
        shape, scale, q.as<float>(), k.as<float>(), v.as<float>(), g.as<float>(),
        beta.as<float>(), init, d_o.as<float>(), d_final, r.dq.as<float>(), r.dk.as<float>(),
        r.dv.as<float>(), r.dg.as<float>(), r.dbeta.as<float>(), r.d_initial_state.as<float>());
  }
  return r;
}

void run_case(const GdnCase& c) {
  const std::vector<int32_t> offsets = offsets_of(c.lengths);
  const int N = static_cast<int>(c.lengths.size());
  const int64_t T = offsets.back();
  const int Hk = c.key_heads, Hv = c.value_heads, Dk = c.key_dim, Dv = c.value_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  std::printf("case: N=%d T=%lld Hk=%d Hv=%d Dk=%d Dv=%d states=%d\n", N,
              static_cast<long long>(T), Hk, Hv, Dk, Dv, c.with_states ? 1 : 0);

  // Inputs as the layer produces them: unit q, k; beta in (0, 1); g = -softplus(.) <= 0.
  const HostTensor q = unit_rows_bf16(random_normal_tensor(Shape{T, Hk, Dk}, 51), Dk);
  const HostTensor k = unit_rows_bf16(random_normal_tensor(Shape{T, Hk, Dk}, 52), Dk);
  const HostTensor v = bf16_rounded(random_normal_tensor(Shape{T, Hv, Dv}, 53));
  HostTensor g = random_normal_tensor(Shape{T, Hv}, 54);
  HostTensor beta = random_normal_tensor(Shape{T, Hv}, 55);
  for (int64_t i = 0; i < T * Hv; ++i) {
    g.as<float>()[i] = -std::log1p(std::exp(g.as<float>()[i] - 2.0f));
    beta.as<float>()[i] = 1.0f / (1.0f + std::exp(-beta.as<float>()[i]));
  }
  const HostTensor d_o = bf16_rounded(random_normal_tensor(Shape{T, Hv, Dv}, 56));
  const HostTensor h0 = random_normal_tensor(Shape{N, Hv, Dk, Dv}, 57, 0.5f);
  const HostTensor dh_final = random_normal_tensor(Shape{N, Hv, Dk, Dv}, 58, 0.5f);

  // GPU.
  DeviceTensor d_cu = upload_offsets(offsets);
  GatedDeltaRuleShape gpu_shape{static_cast<const int32_t*>(d_cu.view.data), N, T, Hk, Hv, Dk, Dv};
  DeviceTensor dq_in = to_device(q, DType::bf16), dk_in = to_device(k, DType::bf16);
  DeviceTensor dv_in = to_device(v, DType::bf16), dg_in = to_device(g), dbeta_in = to_device(beta);
  DeviceTensor ddo_in = to_device(d_o, DType::bf16);
  DeviceTensor dh0 = to_device(h0), ddh_final = to_device(dh_final);
  DeviceTensor o = poisoned(DType::bf16, Shape{T, Hv, Dv});
  DeviceTensor final_state = poisoned(DType::f32, Shape{N, Hv, Dk, Dv});
  DeviceTensor dq = poisoned(DType::bf16, Shape{T, Hk, Dk});
  DeviceTensor dk = poisoned(DType::bf16, Shape{T, Hk, Dk});
  DeviceTensor dv = poisoned(DType::bf16, Shape{T, Hv, Dv});
  DeviceTensor dg = poisoned(DType::f32, Shape{T, Hv});
  DeviceTensor dbeta = poisoned(DType::f32, Shape{T, Hv});
  DeviceTensor d_init = poisoned(DType::f32, Shape{N, Hv, Dk, Dv});
  const size_t fwd_bytes = gated_delta_rule_forward_workspace_bytes(gpu_shape);
  const size_t bwd_bytes = gated_delta_rule_backward_workspace_bytes(gpu_shape);
  DeviceBuffer workspace(std::max(fwd_bytes, bwd_bytes));
  // Poison the workspace too: every value the kernels read must have been written first.
  CUDA_CHECK(cudaMemset(workspace.data(), 0xFF, workspace.bytes()));
  const float* init_ptr = c.with_states ? f32_ptr(dh0) : nullptr;
  const float* d_final_ptr = c.with_states ? f32_ptr(ddh_final) : nullptr;
  auto forward = [&] {
    gated_delta_rule_forward_cuda(gpu_shape, scale, bf16_ptr(dq_in), bf16_ptr(dk_in),
                                  bf16_ptr(dv_in), f32_ptr(dg_in), f32_ptr(dbeta_in), init_ptr,
                                  bf16_ptr(o), f32_ptr(final_state), workspace.data(),
                                  workspace.bytes(), nullptr);
  };
  auto backward = [&] {
    gated_delta_rule_backward_cuda(gpu_shape, scale, bf16_ptr(dq_in), bf16_ptr(dk_in),
                                   bf16_ptr(dv_in), f32_ptr(dg_in), f32_ptr(dbeta_in), init_ptr,
                                   bf16_ptr(ddo_in), d_final_ptr, bf16_ptr(dq), bf16_ptr(dk),
                                   bf16_ptr(dv), f32_ptr(dg), f32_ptr(dbeta), f32_ptr(d_init),
                                   workspace.data(), workspace.bytes(), nullptr);
  };
  forward();
  device_synchronize();
  Outputs got;
  got.o = download_f32(o);
  got.final_state = download_f32(final_state);
  CUDA_CHECK(cudaMemset(workspace.data(), 0xFF, workspace.bytes()));
  backward();
  device_synchronize();
  got.dq = download_f32(dq);
  got.dk = download_f32(dk);
  got.dv = download_f32(dv);
  got.dg = download_f32(dg);
  got.dbeta = download_f32(dbeta);
  got.d_initial_state = download_f32(d_init);
  // Fingerprints of every result, for comparing two builds of the kernels bit for bit.
  const std::string label = std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_T" +
                            std::to_string(T) + "_N" + std::to_string(N) + "_Dk" + std::to_string(Dk) + "_Dv" +
                            std::to_string(Dv) + (c.with_states ? "_states" : "");
  for (const auto& [name, tensor] :
       {std::pair{"o", &got.o}, std::pair{"final_state", &got.final_state}, std::pair{"dq", &got.dq},
        std::pair{"dk", &got.dk}, std::pair{"dv", &got.dv}, std::pair{"dg", &got.dg}, std::pair{"dbeta", &got.dbeta},
        std::pair{"d_initial_state", &got.d_initial_state}})
    print_bit_fingerprint(label.c_str(), name, *tensor);
  // Deterministic: a second backward over the same inputs gives the same bits (no ordering of
  // atomics can change a rounding).
  backward();
  device_synchronize();
  for (const auto& [name, first, again] :
       {std::tuple{"dq", &got.dq, download_f32(dq)}, std::tuple{"dk", &got.dk, download_f32(dk)},
        std::tuple{"dv", &got.dv, download_f32(dv)}, std::tuple{"dg", &got.dg, download_f32(dg)},
        std::tuple{"dbeta", &got.dbeta, download_f32(dbeta)}}) {
    EXPECT_EQ(std::memcmp(first->data(), again.data(), first->nbytes()), 0) << name << " differs on a rerun";
  }
  // A forward whose workspace is kept, then the backward after it, twice (it only reads the kept
  // workspace): the same bits as the recomputing backward's, every other buffer poisoned first.
  DeviceBuffer kept_forward(fwd_bytes);
  DeviceBuffer backward_own(gated_delta_rule_backward_after_forward_workspace_bytes(gpu_shape));
  EXPECT_EQ(backward_own.bytes() + fwd_bytes, bwd_bytes) << "the backward's workspace is the forward's and its own";
  CUDA_CHECK(cudaMemset(kept_forward.data(), 0xFF, kept_forward.bytes()));
  device_fill_bytes(o.view, 0xFF);
  device_fill_bytes(final_state.view, 0xFF);
  gated_delta_rule_forward_cuda(gpu_shape, scale, bf16_ptr(dq_in), bf16_ptr(dk_in), bf16_ptr(dv_in), f32_ptr(dg_in),
                                f32_ptr(dbeta_in), init_ptr, bf16_ptr(o), f32_ptr(final_state), kept_forward.data(),
                                kept_forward.bytes(), nullptr);
  device_synchronize();
  EXPECT_EQ(std::memcmp(got.o.data(), download_f32(o).data(), got.o.nbytes()), 0) << "o of the kept forward";
  EXPECT_EQ(std::memcmp(got.final_state.data(), download_f32(final_state).data(), got.final_state.nbytes()), 0)
      << "final_state of the kept forward";
  auto backward_after_forward = [&] {
    gated_delta_rule_backward_after_forward_cuda(
        gpu_shape, scale, bf16_ptr(dq_in), bf16_ptr(dk_in), bf16_ptr(dv_in), f32_ptr(dg_in), f32_ptr(dbeta_in),
        init_ptr, bf16_ptr(ddo_in), d_final_ptr, bf16_ptr(dq), bf16_ptr(dk), bf16_ptr(dv), f32_ptr(dg),
        f32_ptr(dbeta), f32_ptr(d_init), kept_forward.data(), kept_forward.bytes(), backward_own.data(),
        backward_own.bytes(), nullptr);
  };
  for (int pass = 0; pass < 2; ++pass) {
    CUDA_CHECK(cudaMemset(backward_own.data(), 0xFF, backward_own.bytes()));
    CUDA_CHECK(cudaMemset(workspace.data(), 0xFF, workspace.bytes()));
    for (DeviceTensor* t : {&dq, &dk, &dv, &dg, &dbeta, &d_init}) device_fill_bytes(t->view, 0xFF);
    backward_after_forward();
    device_synchronize();
    for (const auto& [name, first, kept] :
         {std::tuple{"dq", &got.dq, download_f32(dq)}, std::tuple{"dk", &got.dk, download_f32(dk)},
          std::tuple{"dv", &got.dv, download_f32(dv)}, std::tuple{"dg", &got.dg, download_f32(dg)},
          std::tuple{"dbeta", &got.dbeta, download_f32(dbeta)},
          std::tuple{"d_initial_state", &got.d_initial_state, download_f32(d_init)}}) {
      EXPECT_EQ(std::memcmp(first->data(), kept.data(), first->nbytes()), 0)
          << name << " after a kept forward (pass " << pass << ") differs from the recomputing backward";
    }
  }

  // CPU references on the whole problem or on one key head's slice (heads are independent).
  const int kh = c.check_key_head >= 0 ? c.check_key_head : 0;
  const int kh_count = c.check_key_head >= 0 ? 1 : Hk;
  const int group = Hv / Hk, h0_index = kh * group, hv_count = kh_count * group;
  if (c.check_key_head >= 0) {
    std::printf("  comparing key head %d and value heads %d..%d only\n", kh, h0_index,
                h0_index + hv_count - 1);
  }
  const HostTensor q_s = head_slice(q, kh, kh_count), k_s = head_slice(k, kh, kh_count);
  const HostTensor v_s = head_slice(v, h0_index, hv_count), g_s = head_slice(g, h0_index, hv_count);
  const HostTensor beta_s = head_slice(beta, h0_index, hv_count);
  const HostTensor do_s = head_slice(d_o, h0_index, hv_count);
  const HostTensor h0_s = state_slice(h0, h0_index, hv_count);
  const HostTensor dhf_s = state_slice(dh_final, h0_index, hv_count);
  const GatedDeltaRuleShape ref_shape{offsets.data(), N, T, kh_count, hv_count, Dk, Dv};
  const Outputs got_s{head_slice(got.o, h0_index, hv_count),
                      state_slice(got.final_state, h0_index, hv_count),
                      head_slice(got.dq, kh, kh_count),
                      head_slice(got.dk, kh, kh_count),
                      head_slice(got.dv, h0_index, hv_count),
                      head_slice(got.dg, h0_index, hv_count),
                      head_slice(got.dbeta, h0_index, hv_count),
                      state_slice(got.d_initial_state, h0_index, hv_count)};
  for (bool chunked : {true, false}) {
    const std::string form = chunked ? "chunked" : "recurrent";
    std::printf("  vs %s reference:\n", form.c_str());
    const Outputs ref = run_reference(chunked, ref_shape, scale, q_s, k_s, v_s, g_s, beta_s,
                                      c.with_states ? &h0_s : nullptr, do_s,
                                      c.with_states ? &dhf_s : nullptr);
    expect_close(form + " o", got_s.o, ref.o, kBf16Tolerance);
    expect_close(form + " final_state", got_s.final_state, ref.final_state, kF32Tolerance);
    expect_close(form + " dq", got_s.dq, ref.dq, kBf16Tolerance);
    expect_close(form + " dk", got_s.dk, ref.dk, kBf16Tolerance);
    expect_close(form + " dv", got_s.dv, ref.dv, kBf16Tolerance);
    expect_close(form + " dg", got_s.dg, ref.dg, kF32Tolerance);
    expect_close(form + " dbeta", got_s.dbeta, ref.dbeta, kF32Tolerance);
    expect_close(form + " d_initial_state", got_s.d_initial_state, ref.d_initial_state,
                 kF32Tolerance);
  }

  if (c.time_it) {
    const double fwd_ms = median_ms(forward, 2, 10);
    const double bwd_ms = median_ms(backward, 2, 10);
    const double flops = forward_flops(c, T);
    std::printf("  TIMING gated_delta_rule forward  %8.3f ms  %7.1f TFLOP/s (~%.1f GFLOP; floor "
                "%.3f ms at %.0f TFLOP/s bf16; anchors FlashQLA 0.28 ms, FLA 0.47 ms)\n",
                fwd_ms, flops / (fwd_ms * 1e-3) / 1e12, flops / 1e9,
                flops / (kH200Bf16Tflops * 1e12) * 1e3, kH200Bf16Tflops);
    // The backward recomputes the forward and does about twice its work again.
    std::printf("  TIMING gated_delta_rule backward %8.3f ms  %7.1f TFLOP/s (~%.1f GFLOP; floor "
                "%.3f ms; anchors FlashQLA 0.79 ms, FLA 1.44 ms)\n",
                bwd_ms, 3 * flops / (bwd_ms * 1e-3) / 1e12, 3 * flops / 1e9,
                3 * flops / (kH200Bf16Tflops * 1e12) * 1e3);
    const double kept_ms = median_ms(backward_after_forward, 2, 10);
    std::printf("  TIMING gated_delta_rule backward after a kept forward %8.3f ms (the recompute skipped: "
                "%.3f ms less)\n",
                kept_ms, bwd_ms - kept_ms);
    std::printf("  workspace: forward %.1f MiB, backward %.1f MiB (after a kept forward: its own %.1f MiB)\n",
                fwd_bytes / 1048576.0, bwd_bytes / 1048576.0, backward_own.bytes() / 1048576.0);
    auto print_stages = [&](const char* variant) {
      const std::vector<GatedDeltaRuleStageTime> stages = gated_delta_rule_stage_times_cuda(
          gpu_shape, scale, bf16_ptr(dq_in), bf16_ptr(dk_in), bf16_ptr(dv_in), f32_ptr(dg_in),
          f32_ptr(dbeta_in), init_ptr, bf16_ptr(o), f32_ptr(final_state), bf16_ptr(ddo_in),
          d_final_ptr, bf16_ptr(dq), bf16_ptr(dk), bf16_ptr(dv), f32_ptr(dg), f32_ptr(dbeta),
          f32_ptr(d_init), workspace.data(), workspace.bytes(), nullptr, 10);
      for (const GatedDeltaRuleStageTime& stage : stages)
        std::printf("  STAGE%s %-40s %8.3f ms\n", variant, stage.name.c_str(), stage.ms);
    };
    print_stages("");
  }
}

TEST(GatedDeltaRuleGpu, PackedAroundChunkBoundariesTraining) {
  run_case({{1, 63, 64, 65, 130}, 2, 4, 64, 64, false});
}

TEST(GatedDeltaRuleGpu, OddHeadDimsWithStates) {
  run_case({{1, 63, 64, 65, 130}, 1, 3, 37, 45, true});
}

TEST(GatedDeltaRuleGpu, FullHeadDimsWithStates) {
  run_case({{65, 130}, 2, 4, 128, 128, true});
}

// 96 value columns: the forward scan's and the output's second 64-column block is partial, the
// reverse scan's third 32-column block is full.
TEST(GatedDeltaRuleGpu, ValueDimOfOneAndAHalfScanBlocksWithStates) {
  run_case({{65, 130}, 2, 4, 128, 96, true});
}

TEST(GatedDeltaRuleGpu, SingleToken) { run_case({{1}, 1, 2, 16, 24, true}); }

TEST(GatedDeltaRuleGpu, EmptySequenceInTheMiddle) { run_case({{5, 0, 70}, 1, 1, 32, 32, true}); }

TEST(GatedDeltaRuleGpu, ManyShortSequences) {
  std::vector<int> lengths;
  for (int i = 0; i < 40; ++i) lengths.push_back(1 + (i * 37) % 70);
  run_case({lengths, 2, 4, 32, 32, false});
}

// 8,192 tokens in 1,024 sequences (the engine's plan at one sample per 8 tokens): lengths 0, 1, 64,
// 65, 128, 129 and short ones, the rest in one long last sequence, so that most chunks begin a
// sequence (initial state, no state slot) and the state slots of the long ones stay distinct.
std::vector<int> many_sequences_in_8192_tokens() {
  std::vector<int> lengths;
  for (int i = 0; i < 1023; ++i) lengths.push_back(1 + (i * 7) % 12);
  const int special[][2] = {{0, 1}, {1, 64}, {2, 65}, {3, 0}, {4, 129}, {500, 128}, {501, 64},
                            {502, 1}, {1000, 0}, {1022, 64}};
  for (const auto& [at, len] : special) lengths[at] = len;
  int used = 0;
  for (int len : lengths) used += len;
  lengths.push_back(8192 - used);
  return lengths;
}

TEST(GatedDeltaRuleGpu, ManySequencesIn8192TokensWithStates) {
  const std::vector<int> lengths = many_sequences_in_8192_tokens();
  ASSERT_EQ(lengths.size(), 1024u);
  ASSERT_GT(lengths.back(), 3 * 64);  // the last sequence spans several chunks
  run_case({lengths, 2, 4, 32, 32, true});
}

TEST(GatedDeltaRuleGpu, ManySequencesIn8192TokensOddDims) {
  run_case({many_sequences_in_8192_tokens(), 1, 3, 37, 45, false});
}

// Qwen3.5-35B-A3B linear attention: Hk = 16, Hv = 32, Dk = Dv = 128; 8192 tokens as 2 x 4096.
TEST(GatedDeltaRuleGpu, Qwen35BShapeTimed) {
  GdnCase c{{4096, 4096}, 16, 32, 128, 128, false};
  c.check_key_head = 5;
  c.time_it = true;
  run_case(c);
}

}  // namespace
}  // namespace deltamoe
