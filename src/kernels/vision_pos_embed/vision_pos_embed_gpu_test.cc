// GPU test of the interpolated position embedding (4-tap gather forward, inverted-tap gather
// backward) against the fp32 reference on the same bf16 inputs over image grids from one merge
// block to 64x48 patches, packed images and a 2-frame video; timing at 8 images of 448x448.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kernels/gemm/gpu_test_util.h"
#include "kernels/gemm/gpu_timing.h"
#include "kernels/vision_grid/vision_grid.h"
#include "kernels/vision_pos_embed/vision_pos_embed.h"
#include "kernels/vision_pos_embed/vision_pos_embed_cuda.h"

namespace deltamoe {
namespace {

constexpr int64_t kMergeSize = 2;

struct DeviceTaps {
  DeviceTensor index, weight, row_offsets, entries;
  int64_t num_patches = 0;
};

// The taps as the tower prepares them: on the host from grid_thw, then uploaded with their inverse.
DeviceTaps upload_taps(const std::vector<int64_t>& grid_thw, int64_t grid_side, HostTensor* index_out,
                       HostTensor* weight_out) {
  const int64_t images = static_cast<int64_t>(grid_thw.size()) / 3;
  const int64_t patches = vision_num_patches(grid_thw.data(), images);
  HostTensor index(DType::i64, {patches, 4}), weight(DType::f32, {patches, 4});
  vision_pos_embed_taps(grid_thw.data(), images, grid_side, kMergeSize, index.as<int64_t>(), weight.as<float>());
  HostTensor offsets(DType::i32, {grid_side * grid_side + 1}), entries(DType::i32, {patches * 4});
  vision_pos_embed_invert_taps(index.as<int64_t>(), patches, grid_side * grid_side, offsets.as<int32_t>(),
                               entries.as<int32_t>());
  DeviceTaps taps{to_device(index), to_device(weight), to_device(offsets), to_device(entries), patches};
  *index_out = index;
  *weight_out = weight;
  return taps;
}

void check_pos_embed(const std::vector<int64_t>& grid_thw, int64_t grid_side, int64_t hidden, uint64_t seed) {
  std::printf("vision_pos_embed images=%zu G=%lld C=%lld grid_thw:", grid_thw.size() / 3,
              static_cast<long long>(grid_side), static_cast<long long>(hidden));
  for (size_t i = 0; i < grid_thw.size(); i += 3)
    std::printf(" [%lld,%lld,%lld]", static_cast<long long>(grid_thw[i]), static_cast<long long>(grid_thw[i + 1]),
                static_cast<long long>(grid_thw[i + 2]));
  std::printf("\n");
  HostTensor index, weight;
  DeviceTaps taps = upload_taps(grid_thw, grid_side, &index, &weight);
  const int64_t patches = taps.num_patches, table_rows = grid_side * grid_side;
  HostTensor table = random_normal_tensor({table_rows, hidden}, seed);  // the fp32 master table
  HostTensor out_init = random_bf16_exact({patches, hidden}, seed + 1);  // the bf16 patch embeddings
  HostTensor d_out = random_normal_tensor({patches, hidden}, seed + 2);  // the fp32 stream gradient
  HostTensor d_table_init = random_normal_tensor({table_rows, hidden}, seed + 3);
  HostTensor out_ref = out_init.to_f32(), d_table_ref = random_normal_tensor({table_rows, hidden}, seed + 3);
  vision_pos_embed_forward_ref(table.as<float>(), index.as<int64_t>(), weight.as<float>(), out_ref.as<float>(),
                               patches, hidden);
  vision_pos_embed_backward_ref(d_out.as<float>(), index.as<int64_t>(), weight.as<float>(), d_table_ref.as<float>(),
                                patches, hidden);

  DeviceTensor table_d = to_device(table, DType::f32), in_d = to_device(out_init, DType::bf16);
  DeviceTensor out_d = poisoned_device_tensor(DType::f32, {patches, hidden});
  DeviceTensor d_out_d = to_device(d_out, DType::f32), d_table_d = to_device(d_table_init, DType::f32);
  vision_pos_embed_forward_cuda(f32_ptr(table_d), taps.index.view.as<int64_t>(), f32_ptr(taps.weight), bf16_ptr(in_d),
                                f32_ptr(out_d), patches, hidden, nullptr);
  vision_pos_embed_backward_cuda(f32_ptr(d_out_d), f32_ptr(taps.weight), taps.row_offsets.view.as<int32_t>(),
                                 taps.entries.view.as<int32_t>(), f32_ptr(d_table_d), patches, table_rows, hidden,
                                 nullptr);
  device_synchronize();
  expect_close("in + pos_embed (f32)", out_d, out_ref, 1e-6);  // fp32 sums in another order only
  expect_close("d_table (f32, added to)", d_table_d, d_table_ref, 1e-4);
}

TEST(VisionPosEmbedGpu, MatchesReferenceOverGrids) {
  check_pos_embed({1, 2, 2}, 4, 8, 10);                        // one merge block, tiny table
  check_pos_embed({1, 6, 10}, 5, 129, 20);                     // odd width: scalar path
  check_pos_embed({2, 4, 6}, 7, 64, 30);                       // 2 temporal slices repeat the embedding
  check_pos_embed({1, 32, 32}, 48, 1152, 40);                  // real table and width, 32x32 patches
  check_pos_embed({1, 64, 48, 1, 32, 32, 1, 2, 4}, 48, 1152, 50);  // several images packed, 64x48 upsampled
  check_pos_embed({1, 96, 100}, 48, 64, 60);                   // grid larger than the table (many taps per row)
}

TEST(VisionPosEmbedGpu, BackwardIsDeterministic) {
  const std::vector<int64_t> grid_thw = {1, 64, 48, 1, 32, 32};
  const int64_t grid_side = 48, hidden = 1152, table_rows = grid_side * grid_side;
  HostTensor index, weight;
  DeviceTaps taps = upload_taps(grid_thw, grid_side, &index, &weight);
  DeviceTensor d_out = to_device(random_normal_tensor({taps.num_patches, hidden}, 70), DType::f32);
  HostTensor runs[2];
  for (HostTensor& run : runs) {
    DeviceTensor d_table = device_tensor(DType::f32, {table_rows, hidden});
    device_fill_bytes(d_table.view, 0);
    vision_pos_embed_backward_cuda(f32_ptr(d_out), f32_ptr(taps.weight), taps.row_offsets.view.as<int32_t>(),
                                   taps.entries.view.as<int32_t>(), f32_ptr(d_table), taps.num_patches, table_rows,
                                   hidden, nullptr);
    run = to_host(d_table.view);
  }
  const bool identical = std::memcmp(runs[0].data(), runs[1].data(), runs[0].nbytes()) == 0;
  std::printf("  d_table bit-identical over two runs: %s\n", identical ? "yes" : "NO");
  EXPECT_TRUE(identical);
}

TEST(VisionPosEmbedGpu, BadTapsAreRejected) {
  const int64_t index[4] = {0, 1, 2, 9};  // 9 is outside a 3x3 table
  int32_t offsets[10], entries[4];
  EXPECT_THROW(vision_pos_embed_invert_taps(index, 1, 9, offsets, entries), Error);
  DeviceTensor t = device_tensor(DType::bf16, {4, 8});
  DeviceTensor f = device_tensor(DType::f32, {4, 8});
  EXPECT_THROW(vision_pos_embed_forward_cuda(f32_ptr(f), nullptr, nullptr, bf16_ptr(t), f32_ptr(f), 4, 0, nullptr),
               Error);
}

TEST(VisionPosEmbedGpu, TimingAtVisionShapes) {
  std::vector<int64_t> grid_thw;
  for (int i = 0; i < 8; ++i) grid_thw.insert(grid_thw.end(), {1, 28, 28});  // 8 images of 448x448, patch 16
  const int64_t grid_side = 48, hidden = 1152, table_rows = grid_side * grid_side;
  HostTensor index, weight;
  DeviceTaps taps = upload_taps(grid_thw, grid_side, &index, &weight);
  DeviceTensor table = to_device(random_normal_tensor({table_rows, hidden}, 1), DType::f32);
  DeviceTensor in = tiled_random_device_tensor({taps.num_patches, hidden}, 2, 1.0f);
  DeviceTensor out = device_tensor(DType::f32, {taps.num_patches, hidden});
  DeviceTensor d_table = device_tensor(DType::f32, {table_rows, hidden});
  device_fill_bytes(d_table.view, 0);
  const double patch_bytes = static_cast<double>(taps.num_patches) * hidden * 2;
  const double table_f32_bytes = static_cast<double>(table_rows) * hidden * 4;
  double fwd = median_ms([&](cudaStream_t s) {
    vision_pos_embed_forward_cuda(f32_ptr(table), taps.index.view.as<int64_t>(), f32_ptr(taps.weight), bf16_ptr(in),
                                  f32_ptr(out), taps.num_patches, hidden, s);
  }, nullptr);
  // bf16 in read, fp32 out written; the 10 MiB table stays in L2.
  print_bandwidth_timing("pos_embed 6272x1152 fwd (bf16 in, f32 out)", fwd, 3 * patch_bytes);
  double bwd = median_ms([&](cudaStream_t s) {
    vision_pos_embed_backward_cuda(f32_ptr(out), f32_ptr(taps.weight), taps.row_offsets.view.as<int32_t>(),
                                   taps.entries.view.as<int32_t>(), f32_ptr(d_table), taps.num_patches, table_rows,
                                   hidden, s);
  }, nullptr);
  print_bandwidth_timing("pos_embed 6272x1152 bwd (2304-row table)", bwd, 2 * patch_bytes + 2 * table_f32_bytes);
}

}  // namespace
}  // namespace deltamoe
