// GPU test of the cross-entropy row kernel (against cross_entropy_ref on the same bf16 logits) and
// of the chunked lm_head + cross-entropy (against linear + cross_entropy references), with ignored
// labels, partial last chunks, T = 1, global-count normalisation and a bad label; timing at
// T = 8192, V = 248320, H = 2048.
#include <gtest/gtest.h>

#include "core/rng.h"
#include "kernels/cross_entropy/cross_entropy.h"
#include "kernels/cross_entropy/cross_entropy_cuda.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/linear/linear.h"

namespace deltamoe {
namespace {

// Labels in [0, V) with about a fifth -100.
HostTensor random_labels(int64_t count, int64_t vocab, uint64_t seed) {
  HostTensor labels(DType::i64, {count});
  Rng rng(seed);
  for (int64_t i = 0; i < count; ++i) {
    const bool ignored = rng.uniform() < 0.2f;
    const int64_t id = static_cast<int64_t>(rng.uniform() * static_cast<float>(vocab)) % vocab;
    labels.as<int64_t>()[i] = ignored ? kIgnoreIndex : id;
  }
  return labels;
}

HostTensor round_tensor_to_bf16(const HostTensor& t) { return t.to_dtype(DType::bf16).to_f32(); }

DeviceTensor zero_flag() {
  HostTensor flag(DType::i32, {1});
  return to_device(flag);
}

void check_rows(int64_t rows, int64_t vocab, uint64_t seed) {
  std::printf("cross_entropy rows=%lld V=%lld\n", static_cast<long long>(rows), static_cast<long long>(vocab));
  HostTensor logits = random_bf16_exact({rows, vocab}, seed, 4.0f);
  HostTensor labels = random_labels(rows, vocab, seed + 1);
  HostTensor lse_ref(DType::f32, {rows}), d_ref(DType::f32, {rows, vocab}), token_loss_ref(DType::f32, {rows});
  int64_t count = 0;
  cross_entropy_forward_ref(logits.as<float>(), labels.as<int64_t>(), lse_ref.as<float>(), rows, vocab, &count);
  const float d_loss = 1.5f;
  cross_entropy_backward_ref(logits.as<float>(), labels.as<int64_t>(), lse_ref.as<float>(), d_loss, d_ref.as<float>(),
                             rows, vocab);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t label = labels.as<int64_t>()[r];
    token_loss_ref.as<float>()[r] =
        label == kIgnoreIndex ? 0.0f : lse_ref.as<float>()[r] - logits.as<float>()[r * vocab + label];
  }
  DeviceTensor logits_d = to_device(logits, DType::bf16), labels_d = to_device(labels);
  DeviceTensor lse_d = poisoned_device_tensor(DType::f32, {rows});
  DeviceTensor token_loss_d = poisoned_device_tensor(DType::f32, {rows});
  DeviceTensor flag = zero_flag();
  const float grad_scale = count > 0 ? d_loss / static_cast<float>(count) : 0.0f;
  cross_entropy_rows_cuda(bf16_ptr(logits_d), labels_d.view.as<int64_t>(), rows, vocab, true, grad_scale,
                          f32_ptr(token_loss_d), f32_ptr(lse_d), flag.view.as<int32_t>(), nullptr);
  device_synchronize();
  // The reference sums exp() sequentially in fp32 (error grows like sqrt(V) ulps, ~2e-5 at
  // V = 1e5); the kernel's tree sum differs by about that much.
  expect_close("lse (f32)", lse_d, lse_ref, 1e-5);
  // Token losses are differences lse - logit: compare absolutely against the lse scale.
  CompareResult token = compare_tensors("token loss (f32)", to_host(token_loss_d.view), token_loss_ref);
  EXPECT_TRUE(token.all_finite);
  EXPECT_LE(token.max_abs_diff, 1e-5 * std::max(1.0, token.max_abs_ref));
  expect_close("d_logits in place (bf16)", logits_d, d_ref, 1e-2);
  EXPECT_EQ(to_host(flag.view).as<int32_t>()[0], 0);
}

TEST(CrossEntropyGpu, RowKernelMatchesReference) {
  check_rows(1, 1000, 1);     // T = 1
  check_rows(37, 1000, 2);    // vector path
  check_rows(20, 1003, 3);    // odd vocabulary: scalar path
  check_rows(5, 100000, 4);   // long rows, many iterations per thread
  check_rows(9, 7, 5);        // vocabulary smaller than the block: idle threads
}

struct LmHeadCase {
  int64_t tokens, hidden, vocab, chunk_rows, extra_global_count;
  bool listed = false;  // only the supervised rows, listed (LmHeadLossArgs::rows)
  bool written = false;  // d_weight written by the first chunk (LmHeadLossArgs::d_weight_written), not added to
};

// The rows whose label is not ignored, in order, on the device.
std::vector<int32_t> supervised_rows(const HostTensor& labels) {
  std::vector<int32_t> rows;
  for (int64_t i = 0; i < labels.numel(); ++i)
    if (labels.as<int64_t>()[i] != kIgnoreIndex) rows.push_back(static_cast<int32_t>(i));
  return rows;
}

DeviceBuffer rows_to_device(const std::vector<int32_t>& rows) {
  DeviceBuffer out(std::max<size_t>(rows.size(), 1) * sizeof(int32_t));
  if (!rows.empty())
    CUDA_CHECK(cudaMemcpy(out.data(), rows.data(), rows.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  return out;
}

void check_lm_head(const LmHeadCase& c, uint64_t seed) {
  std::printf("lm_head+CE T=%lld H=%lld V=%lld chunk=%lld global count = local + %lld%s%s\n",
              static_cast<long long>(c.tokens), static_cast<long long>(c.hidden), static_cast<long long>(c.vocab),
              static_cast<long long>(c.chunk_rows), static_cast<long long>(c.extra_global_count),
              c.listed ? ", supervised rows listed" : "", c.written ? ", d_weight written" : "");
  HostTensor x = random_bf16_exact({c.tokens, c.hidden}, seed);
  HostTensor w = random_bf16_exact({c.vocab, c.hidden}, seed + 1, 2.0f / std::sqrt(static_cast<float>(c.hidden)));
  HostTensor labels = random_labels(c.tokens, c.vocab, seed + 2);
  HostTensor dw_init = random_normal_tensor({c.vocab, c.hidden}, seed + 3, 0.01f);

  // Reference: fp32 logits, rounded to bf16 as the GPU stores them (HF's bf16 lm_head does too).
  HostTensor logits32(DType::f32, {c.tokens, c.vocab});
  linear_forward_ref(x.as<float>(), w.as<float>(), logits32.as<float>(), c.tokens, c.hidden, c.vocab);
  HostTensor logits = round_tensor_to_bf16(logits32);
  HostTensor lse_ref(DType::f32, {c.tokens}), lse32(DType::f32, {c.tokens});
  int64_t local_count = 0;
  const double mean_local =
      cross_entropy_forward_ref(logits.as<float>(), labels.as<int64_t>(), lse_ref.as<float>(), c.tokens, c.vocab,
                                &local_count);
  const double mean_local_fp32_logits =
      cross_entropy_forward_ref(logits32.as<float>(), labels.as<int64_t>(), lse32.as<float>(), c.tokens, c.vocab,
                                &local_count);
  const int64_t global_count = local_count + c.extra_global_count;
  const double loss_ref = global_count > 0 ? mean_local * local_count / global_count : 0.0;
  const float d_loss = 2.0f;
  // The reference normalises by its local count; rescale d_loss to the global count.
  const float d_loss_ref = global_count > 0 ? d_loss * static_cast<float>(local_count) / global_count : 0.0f;
  HostTensor d_logits(DType::f32, {c.tokens, c.vocab});
  cross_entropy_backward_ref(logits.as<float>(), labels.as<int64_t>(), lse_ref.as<float>(), d_loss_ref,
                             d_logits.as<float>(), c.tokens, c.vocab);
  HostTensor dx_ref(DType::f32, {c.tokens, c.hidden});
  HostTensor dw_ref = random_normal_tensor({c.vocab, c.hidden}, seed + 3, 0.01f);
  linear_backward_ref(x.as<float>(), w.as<float>(), d_logits.as<float>(), dx_ref.as<float>(), dw_ref.as<float>(),
                      c.tokens, c.hidden, c.vocab);
  // Only the added part of d_weight is compared (the initial value would dominate the norm).
  for (int64_t i = 0; i < c.vocab * c.hidden; ++i) dw_ref.as<float>()[i] -= dw_init.as<float>()[i];
  // Written: whatever d_weight held (NaN bits here) must be neither read nor left.
  if (c.written) std::fill(dw_init.as<float>(), dw_init.as<float>() + c.vocab * c.hidden, 0.0f);

  DeviceTensor x_d = to_device(x, DType::bf16), w_d = to_device(w, DType::bf16), labels_d = to_device(labels);
  DeviceTensor token_loss_d = poisoned_device_tensor(DType::f32, {c.tokens});
  DeviceTensor lse_d = poisoned_device_tensor(DType::f32, {c.tokens});
  DeviceTensor loss_d = poisoned_device_tensor(DType::f32, {1});
  DeviceTensor dx_d = poisoned_device_tensor(DType::bf16, {c.tokens, c.hidden});
  DeviceTensor dw_d = c.written ? poisoned_device_tensor(DType::f32, {c.vocab, c.hidden}) : to_device(dw_init, DType::f32);
  DeviceTensor flag = zero_flag();
  DeviceBuffer workspace(lm_head_cross_entropy_workspace_bytes(c.chunk_rows, c.vocab, c.hidden));
  const std::vector<int32_t> rows = supervised_rows(labels);
  const DeviceBuffer rows_d = rows_to_device(rows);
  GemmContext ctx;
  LmHeadLossArgs args;
  if (c.listed) {
    args.rows = rows_d.as<int32_t>();
    args.num_rows = static_cast<int64_t>(rows.size());
  }
  args.hidden = bf16_ptr(x_d);
  args.weight = bf16_ptr(w_d);
  args.labels = labels_d.view.as<int64_t>();
  args.num_tokens = c.tokens;
  args.hidden_size = c.hidden;
  args.vocab = c.vocab;
  args.num_supervised = global_count;
  args.d_loss = d_loss;
  args.chunk_rows = c.chunk_rows;
  args.token_loss = f32_ptr(token_loss_d);
  args.lse = f32_ptr(lse_d);
  args.loss = f32_ptr(loss_d);
  args.d_hidden = bf16_ptr(dx_d);
  args.d_weight = f32_ptr(dw_d);
  args.d_weight_written = c.written;
  args.bad_label_position = flag.view.as<int32_t>();
  lm_head_cross_entropy_cuda(ctx, args, workspace.data(), workspace.bytes(), nullptr);
  device_synchronize();

  const float loss = to_host(loss_d.view).as<float>()[0];
  const double loss_error = std::fabs(loss - loss_ref) / std::max(1e-30, std::fabs(loss_ref));
  const double loss_vs_fp32_logits =
      global_count > 0 ? std::fabs(loss - mean_local_fp32_logits * local_count / global_count) / std::fabs(loss_ref)
                       : 0.0;
  std::printf("  loss %.7f  reference %.7f  rel diff %.3e  (vs fp32 logits %.3e)\n", loss, loss_ref, loss_error,
              loss_vs_fp32_logits);
  EXPECT_TRUE(std::isfinite(loss));
  // Our bf16 logits can differ from the rounded reference's by one bf16 step where the fp32 sums
  // land near a rounding boundary; the loss averages that out far below 1e-3.
  EXPECT_LE(loss_error, 1e-3);
  EXPECT_LE(loss_vs_fp32_logits, 1e-2);  // bf16 logits stay close to the exact loss
  if (c.listed) {
    // lse holds the listed rows' values in order; the other rows' input gradient is exactly zero.
    HostTensor lse_got = to_host(lse_d.view), lse_listed(DType::f32, {std::max<int64_t>(1, args.num_rows)}),
               lse_want(DType::f32, {std::max<int64_t>(1, args.num_rows)});
    for (size_t i = 0; i < rows.size(); ++i) {
      lse_listed.as<float>()[i] = lse_got.as<float>()[i];
      lse_want.as<float>()[i] = lse_ref.as<float>()[rows[i]];
    }
    if (!rows.empty()) {
      EXPECT_LE(compare_tensors("lse of the listed rows (f32)", lse_listed, lse_want).rel_l2, 1e-3);
    }
    HostTensor dx_got = to_host(dx_d.view).to_f32();
    int64_t nonzero_unlisted = 0;
    for (int64_t t = 0; t < c.tokens; ++t) {
      if (labels.as<int64_t>()[t] != kIgnoreIndex) continue;
      for (int64_t h = 0; h < c.hidden; ++h) nonzero_unlisted += dx_got.as<float>()[t * c.hidden + h] != 0.0f;
    }
    EXPECT_EQ(nonzero_unlisted, 0) << "d_hidden of rows not listed";
  } else {
    expect_close("lse (f32)", lse_d, lse_ref, 1e-3);
  }
  expect_close("d_hidden (bf16)", dx_d, dx_ref, 1e-2);
  HostTensor dw_added = to_host(dw_d.view);
  for (int64_t i = 0; i < c.vocab * c.hidden; ++i) dw_added.as<float>()[i] -= dw_init.as<float>()[i];
  CompareResult dw = compare_tensors("d_weight added part (f32)", dw_added, dw_ref);
  EXPECT_TRUE(dw.all_finite);
  EXPECT_LE(dw.rel_l2, 1e-2);  // d_logits pass through bf16 before the product: ~2^-9 per element
  EXPECT_EQ(to_host(flag.view).as<int32_t>()[0], 0);
}

TEST(CrossEntropyGpu, ChunkedLmHeadMatchesReference) {
  check_lm_head({67, 96, 1000, 16, 0}, 10);   // 5 chunks, partial last one
  check_lm_head({1, 64, 512, 1024, 0}, 20);   // T = 1, chunk larger than T
  check_lm_head({45, 37, 517, 7, 11}, 30);    // odd H and V (unaligned), global count > local
  check_lm_head({128, 2048, 300, 64, 0}, 40); // the 35B hidden width
}

// d_weight written by the first chunk (the step's first backward into an unzeroed gradient): the
// same values as added to zeros, with what it held before never read.
TEST(CrossEntropyGpu, WrittenWeightGradientMatchesReference) {
  check_lm_head({67, 96, 1000, 16, 0, false, true}, 90);   // several chunks: the first writes, the rest add
  check_lm_head({1, 64, 512, 1024, 0, false, true}, 100);  // one chunk
  check_lm_head({45, 37, 517, 7, 11, true, true}, 110);    // listed rows, odd widths
}

// Only the supervised rows through lm_head: the same loss and gradients as every row.
TEST(CrossEntropyGpu, ListedSupervisedRowsMatchReference) {
  check_lm_head({67, 96, 1000, 16, 0, true}, 50);    // several chunks of listed rows, partial last one
  check_lm_head({1, 64, 512, 1024, 0, true}, 60);    // T = 1 (listed or not, by the seed's draw)
  check_lm_head({45, 37, 517, 7, 11, true}, 70);     // odd H and V (element copies), global count > local
  check_lm_head({128, 2048, 300, 64, 0, true}, 80);  // the 35B hidden width
}

TEST(CrossEntropyGpu, NothingSupervisedGivesZeroLossAndGradient) {
  for (const bool listed : {false, true}) {
    const int64_t tokens = 6, hidden = 16, vocab = 40;
    HostTensor labels(DType::i64, {tokens});
    for (int64_t i = 0; i < tokens; ++i) labels.as<int64_t>()[i] = kIgnoreIndex;
    DeviceTensor x = to_device(random_bf16_exact({tokens, hidden}, 1), DType::bf16);
    DeviceTensor w = to_device(random_bf16_exact({vocab, hidden}, 2), DType::bf16);
    DeviceTensor labels_d = to_device(labels);
    DeviceTensor token_loss = poisoned_device_tensor(DType::f32, {tokens});
    DeviceTensor lse = poisoned_device_tensor(DType::f32, {tokens});
    DeviceTensor loss = poisoned_device_tensor(DType::f32, {1});
    DeviceTensor dx = poisoned_device_tensor(DType::bf16, {tokens, hidden});
    DeviceTensor dw = poisoned_device_tensor(DType::f32, {vocab, hidden});  // written: no chunk runs, zeroed
    DeviceBuffer workspace(lm_head_cross_entropy_workspace_bytes(tokens, vocab, hidden));
    const DeviceBuffer no_rows(sizeof(int32_t));
    GemmContext ctx;
    LmHeadLossArgs args;
    if (listed) {
      args.rows = no_rows.as<int32_t>();  // an empty list
      args.num_rows = 0;
    }
    args.hidden = bf16_ptr(x);
    args.weight = bf16_ptr(w);
    args.labels = labels_d.view.as<int64_t>();
    args.num_tokens = tokens;
    args.hidden_size = hidden;
    args.vocab = vocab;
    args.num_supervised = 0;
    args.chunk_rows = tokens;
    args.token_loss = f32_ptr(token_loss);
    args.lse = f32_ptr(lse);
    args.loss = f32_ptr(loss);
    args.d_hidden = bf16_ptr(dx);
    args.d_weight = f32_ptr(dw);
    args.d_weight_written = true;
    lm_head_cross_entropy_cuda(ctx, args, workspace.data(), workspace.bytes(), nullptr);
    EXPECT_EQ(to_host(loss.view).as<float>()[0], 0.0f) << (listed ? "listed" : "every row");
    HostTensor dx_host = to_host(dx.view).to_f32();
    for (int64_t i = 0; i < tokens * hidden; ++i) EXPECT_EQ(dx_host.as<float>()[i], 0.0f);
    HostTensor dw_host = to_host(dw.view);
    for (int64_t i = 0; i < vocab * hidden; ++i) EXPECT_EQ(dw_host.as<float>()[i], 0.0f);
  }
}

TEST(CrossEntropyGpu, BadLabelIsReportedAndIgnored) {
  const int64_t rows = 3, vocab = 16;
  HostTensor labels(DType::i64, {rows});
  labels.as<int64_t>()[0] = 2;
  labels.as<int64_t>()[1] = vocab;  // out of range
  labels.as<int64_t>()[2] = kIgnoreIndex;
  DeviceTensor logits = to_device(random_bf16_exact({rows, vocab}, 3), DType::bf16);
  DeviceTensor labels_d = to_device(labels), flag = zero_flag();
  DeviceTensor token_loss = poisoned_device_tensor(DType::f32, {rows}), lse = poisoned_device_tensor(DType::f32, {rows});
  cross_entropy_rows_cuda(bf16_ptr(logits), labels_d.view.as<int64_t>(), rows, vocab, false, 0.0f, f32_ptr(token_loss),
                          f32_ptr(lse), flag.view.as<int32_t>(), nullptr);
  EXPECT_EQ(to_host(flag.view).as<int32_t>()[0], 2);  // 1 + row 1
  EXPECT_EQ(to_host(token_loss.view).as<float>()[1], 0.0f);
}

TEST(CrossEntropyGpu, WorkspaceTooSmallIsRejected) {
  GemmContext ctx;
  LmHeadLossArgs args;
  DeviceTensor dummy = device_tensor(DType::bf16, {8});
  args.hidden = args.weight = bf16_ptr(dummy);
  args.labels = reinterpret_cast<const int64_t*>(dummy.view.data);
  args.token_loss = args.lse = args.loss = reinterpret_cast<float*>(dummy.view.data);
  args.num_tokens = 4;
  args.hidden_size = 2;
  args.vocab = 2;
  args.chunk_rows = 4;
  EXPECT_THROW(lm_head_cross_entropy_cuda(ctx, args, dummy.view.data, 8, nullptr), Error);
}

TEST(CrossEntropyGpu, TimingAt35BShapes) {
  const int64_t tokens = 8192, hidden = 2048, vocab = 248320, chunk_rows = 1024;
  DeviceTensor x = to_device(random_normal_tensor({tokens, hidden}, 1), DType::bf16);
  DeviceTensor w = tiled_random_device_tensor({vocab, hidden}, 2, 0.02f);  // 1 GB: tiled, not drawn per element
  DeviceTensor labels = to_device(random_labels(tokens, vocab, 3));
  DeviceTensor token_loss = device_tensor(DType::f32, {tokens}), lse = device_tensor(DType::f32, {tokens});
  DeviceTensor loss = device_tensor(DType::f32, {1});
  DeviceTensor dx = device_tensor(DType::bf16, {tokens, hidden});
  DeviceTensor dw = device_tensor(DType::f32, {vocab, hidden});
  device_fill_bytes(dw.view, 0);
  DeviceBuffer workspace(lm_head_cross_entropy_workspace_bytes(chunk_rows, vocab, hidden));
  GemmContext ctx;
  LmHeadLossArgs args;
  args.hidden = bf16_ptr(x);
  args.weight = bf16_ptr(w);
  args.labels = labels.view.as<int64_t>();
  args.num_tokens = tokens;
  args.hidden_size = hidden;
  args.vocab = vocab;
  args.num_supervised = tokens;
  args.chunk_rows = chunk_rows;
  args.token_loss = f32_ptr(token_loss);
  args.lse = f32_ptr(lse);
  args.loss = f32_ptr(loss);
  const double gemm_flops = 2.0 * tokens * vocab * hidden;
  double fwd = median_ms([&](cudaStream_t s) {
    lm_head_cross_entropy_cuda(ctx, args, workspace.data(), workspace.bytes(), s);
  }, nullptr, 2, 5);
  print_flop_timing("lm_head+CE forward only T=8192 V=248320", fwd, gemm_flops);
  args.d_hidden = bf16_ptr(dx);
  args.d_weight = f32_ptr(dw);
  double full = median_ms([&](cudaStream_t s) {
    lm_head_cross_entropy_cuda(ctx, args, workspace.data(), workspace.bytes(), s);
  }, nullptr, 2, 5);
  print_flop_timing("lm_head+CE fwd+bwd (6 T V H) T=8192", full, 3 * gemm_flops);
  // The step's form: d_weight written by the first chunk (no zeroing pass before, no read of it
  // in the first product), at the engine's default chunk and at the whole batch in one chunk.
  args.d_weight_written = true;
  for (const int64_t chunk : {int64_t{1024}, int64_t{2048}, tokens}) {
    DeviceBuffer chunk_workspace(lm_head_cross_entropy_workspace_bytes(chunk, vocab, hidden));
    args.chunk_rows = chunk;
    const double written = median_ms([&](cudaStream_t s) {
      lm_head_cross_entropy_cuda(ctx, args, chunk_workspace.data(), chunk_workspace.bytes(), s);
    }, nullptr, 2, 5);
    char what[96];
    std::snprintf(what, sizeof(what), "lm_head+CE fwd+bwd, d_weight written, chunk %lld", static_cast<long long>(chunk));
    print_flop_timing(what, written, 3 * gemm_flops);
  }
  args.d_weight_written = false;
  args.chunk_rows = chunk_rows;
  const double zeroing = median_ms([&](cudaStream_t s) {
    CUDA_CHECK(cudaMemsetAsync(dw.view.data, 0, static_cast<size_t>(vocab * hidden) * sizeof(float), s));
  }, nullptr, 2, 5);
  print_bandwidth_timing("zeroing d_weight (the pass written-first skips)", zeroing, 4.0 * vocab * hidden);
  // Half the rows supervised (a chat batch's prompts, an image's tokens), listed: half the work.
  std::vector<int32_t> half;
  for (int32_t t = 0; t < tokens; t += 2) half.push_back(t);
  const DeviceBuffer half_d = rows_to_device(half);
  args.rows = half_d.as<int32_t>();
  args.num_rows = static_cast<int64_t>(half.size());
  double listed = median_ms([&](cudaStream_t s) {
    lm_head_cross_entropy_cuda(ctx, args, workspace.data(), workspace.bytes(), s);
  }, nullptr, 2, 5);
  print_flop_timing("lm_head+CE fwd+bwd, half the rows listed", listed, 1.5 * gemm_flops);
  args.rows = nullptr;
  args.num_rows = 0;
  DeviceTensor row_logits = to_device(random_normal_tensor({chunk_rows, vocab}, 4, 3.0f), DType::bf16);
  double rows_ms = median_ms([&](cudaStream_t s) {
    cross_entropy_rows_cuda(bf16_ptr(row_logits), labels.view.as<int64_t>(), chunk_rows, vocab, false, 0.0f,
                            f32_ptr(token_loss), f32_ptr(lse), nullptr, s);
  }, nullptr);
  print_bandwidth_timing("CE row kernel (lse only) 1024 x 248320", rows_ms, 2.0 * chunk_rows * vocab);
}

}  // namespace
}  // namespace deltamoe
