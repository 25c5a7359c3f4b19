// GPU test of the image-feature scatter into <|image_pad|> rows and its backward (gather + zero)
// against the reference, over packed token streams with runs of pad tokens; timing at 8192 tokens
// holding 8 images of 448x448 (1,568 merged features of the 2048-wide text hidden).
#include <gtest/gtest.h>

#include <vector>

#include "core/rng.h"
#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/token_scatter/token_scatter.h"
#include "kernels/token_scatter/token_scatter_cuda.h"

namespace deltamoe {
namespace {

constexpr int64_t kImagePad = 248056;  // <|image_pad|>

// A packed token stream: text tokens with `images` runs of `run` pad tokens at random places.
std::vector<int64_t> token_stream(int64_t num_tokens, int64_t images, int64_t run, uint64_t seed) {
  std::vector<int64_t> ids(static_cast<size_t>(num_tokens));
  Rng rng(seed);
  for (int64_t& id : ids) id = static_cast<int64_t>(rng.uniform() * 150000.0f);  // text ids below the specials
  const int64_t gap = images > 0 ? num_tokens / images : 0;
  for (int64_t image = 0; image < images; ++image) {
    const int64_t start = image * gap + static_cast<int64_t>(rng.uniform() * static_cast<float>(gap - run));
    for (int64_t t = start; t < start + run; ++t) ids[static_cast<size_t>(t)] = kImagePad;
  }
  return ids;
}

int64_t count_pads(const std::vector<int64_t>& ids) {
  int64_t count = 0;
  for (int64_t id : ids) count += id == kImagePad;
  return count;
}

void check_token_scatter(const std::vector<int64_t>& ids, int64_t hidden, uint64_t seed) {
  const int64_t tokens = static_cast<int64_t>(ids.size()), features = count_pads(ids);
  std::printf("token_scatter T=%lld N=%lld C=%lld\n", static_cast<long long>(tokens), static_cast<long long>(features),
              static_cast<long long>(hidden));
  HostTensor embeds = random_normal_tensor({tokens, hidden}, seed);  // the fp32 stream
  HostTensor feats = random_bf16_exact({features, hidden}, seed + 1);
  // bf16-exact gradients, so that the gathered rows (rounded to bf16) compare exactly.
  HostTensor d_embeds = random_bf16_exact({tokens, hidden}, seed + 2);
  HostTensor embeds_ref = embeds.to_f32(), d_embeds_ref = d_embeds.to_f32();
  HostTensor d_feats_ref(DType::f32, {features, hidden});
  token_scatter_forward_ref(ids.data(), tokens, kImagePad, feats.as<float>(), features, embeds_ref.as<float>(), hidden);
  token_scatter_backward_ref(ids.data(), tokens, kImagePad, d_embeds_ref.as<float>(), d_feats_ref.as<float>(),
                             features, hidden);

  HostTensor pad_rows(DType::i32, {features});
  token_scatter_pad_rows(ids.data(), tokens, kImagePad, features, pad_rows.as<int32_t>());
  DeviceTensor pad_rows_d = to_device(pad_rows);
  DeviceTensor embeds_d = to_device(embeds, DType::f32), feats_d = to_device(feats, DType::bf16);
  DeviceTensor d_embeds_d = to_device(d_embeds, DType::f32);
  DeviceTensor d_feats_d = poisoned_device_tensor(DType::bf16, {features, hidden});
  token_scatter_forward_cuda(pad_rows_d.view.as<int32_t>(), bf16_ptr(feats_d), features, f32_ptr(embeds_d), tokens,
                             hidden, nullptr);
  token_scatter_backward_cuda(pad_rows_d.view.as<int32_t>(), f32_ptr(d_embeds_d), bf16_ptr(d_feats_d), features,
                              tokens, hidden, nullptr);
  device_synchronize();
  // Pure copies and zeros: bit-exact.
  const CompareResult results[] = {
      compare_tensors("embeds with features placed (f32)", to_host(embeds_d.view), embeds_ref),
      compare_tensors("d_embeds with pad rows zeroed (f32)", to_host(d_embeds_d.view), d_embeds_ref),
      compare_tensors("d_features gathered (bf16)", to_host(d_feats_d.view), d_feats_ref)};
  for (const CompareResult& r : results) {
    EXPECT_TRUE(r.all_finite);
    EXPECT_EQ(r.max_abs_diff, 0.0);
  }
}

TEST(TokenScatterGpu, MatchesReferenceOverStreams) {
  check_token_scatter({kImagePad}, 2048, 10);                        // T = 1, one feature
  check_token_scatter(token_stream(37, 2, 4, 1), 129, 20);           // odd width: scalar path
  check_token_scatter(token_stream(40, 0, 0, 2), 64, 30);            // no images: nothing moves
  check_token_scatter(token_stream(2000, 1, 256 + 768, 3), 2048, 40);  // 32x32 + 64x48 patch images merged 2x2
  check_token_scatter(token_stream(3000, 60, 4, 4), 2048, 50);       // many short packed samples, tiny images
}

TEST(TokenScatterGpu, MismatchedCountsAreRejected) {
  const std::vector<int64_t> ids = {1, kImagePad, 2, kImagePad};
  int32_t pad_rows[3];
  EXPECT_THROW(token_scatter_pad_rows(ids.data(), 4, kImagePad, 3, pad_rows), Error);
  EXPECT_THROW(token_scatter_pad_rows(ids.data(), 4, kImagePad, 1, pad_rows), Error);
  DeviceTensor t = device_tensor(DType::bf16, {4, 8});
  DeviceTensor f = device_tensor(DType::f32, {4, 8});
  EXPECT_THROW(token_scatter_forward_cuda(nullptr, bf16_ptr(t), 5, f32_ptr(f), 4, 8, nullptr), Error);
  EXPECT_THROW(token_scatter_backward_cuda(nullptr, f32_ptr(f), bf16_ptr(t), 2, 4, 0, nullptr), Error);
}

TEST(TokenScatterGpu, TimingAt35BShapes) {
  const int64_t tokens = 8192, hidden = 2048;
  const std::vector<int64_t> ids = token_stream(tokens, 8, 196, 5);  // 8 images of 448x448: 28x28 / 4
  const int64_t features = count_pads(ids);
  HostTensor pad_rows(DType::i32, {features});
  token_scatter_pad_rows(ids.data(), tokens, kImagePad, features, pad_rows.as<int32_t>());
  DeviceTensor pad_rows_d = to_device(pad_rows);
  DeviceTensor embeds = to_device(random_normal_tensor({tokens, hidden}, 1), DType::f32);
  DeviceTensor feats = tiled_random_device_tensor({features, hidden}, 2, 1.0f);
  const double feature_bytes = static_cast<double>(features) * hidden * 2;
  double fwd = median_ms([&](cudaStream_t s) {
    token_scatter_forward_cuda(pad_rows_d.view.as<int32_t>(), bf16_ptr(feats), features, f32_ptr(embeds), tokens,
                               hidden, s);
  }, nullptr);
  print_bandwidth_timing("token_scatter 1568 of 8192x2048 fwd", fwd, 3 * feature_bytes);
  double bwd = median_ms([&](cudaStream_t s) {
    token_scatter_backward_cuda(pad_rows_d.view.as<int32_t>(), f32_ptr(embeds), bf16_ptr(feats), features, tokens,
                                hidden, s);
  }, nullptr);
  print_bandwidth_timing("token_scatter 1568 of 8192x2048 bwd", bwd, 5 * feature_bytes);
}

}  // namespace
}  // namespace deltamoe
