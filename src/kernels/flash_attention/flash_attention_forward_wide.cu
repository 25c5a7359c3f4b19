// Pipelined tensor-core forward of packed-segment attention (FlashAttention-2 schedule) for head
// dims in (128, 256] that are multiples of 8: a block of 4 warps owns 64 queries of one head (16
// per warp); the Q tile stays in shared memory, 64-key K and V tiles arrive by cp.async so that V
// loads while S = Q K^T runs and the next K loads while O += P V runs; operands come through
// ldmatrix (.trans for V); online softmax in fp32 registers; causal tiles past the diagonal skipped.
#include <cstdint>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/kernel_path_cuda.h"
#include "kernels/flash_attention/flash_attention_common.cuh"
#include "kernels/flash_attention/flash_attention_cuda.h"
#include "kernels/flash_attention/flash_attention_launch_checks.h"
#include "kernels/flash_attention/flash_attention_mma.cuh"
#include "kernels/flash_attention/flash_attention_pipeline.cuh"
#include "kernels/flash_attention/flash_attention_rows.cuh"

namespace deltamoe {
namespace {

namespace fa = flash_attention_detail;

constexpr int kWarps = 4;
constexpr int kQueryRows = 16 * kWarps;  // queries per block
constexpr int kKeyRows = 64;             // keys per K/V tile
constexpr int kHeadDim = 256;            // padded width of the tiles
constexpr int kStride = kHeadDim + fa::kPad;
// Q, K and V tiles, one each: 99 KB, so two blocks share an H100 SM (one on an A100).
constexpr size_t kSharedBytes = static_cast<size_t>(kQueryRows + 2 * kKeyRows) * kStride * sizeof(uint16_t);

__global__ void __launch_bounds__(32 * kWarps, 2)
    forward_wide_kernel(FlashAttentionShape shape, const __nv_bfloat16* __restrict__ q,
                        const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
                        __nv_bfloat16* __restrict__ out, float* __restrict__ lse) {
  constexpr int kDimTiles = kHeadDim / 8;  // n-tiles of O
  constexpr int kKeyTiles = kKeyRows / 8;  // n-tiles of S
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(shared_bytes);
  uint16_t* k_tile = q_tile + kQueryRows * kStride;
  uint16_t* v_tile = k_tile + kKeyRows * kStride;

  const int num_tokens = static_cast<int>(shape.num_tokens), num_q_heads = static_cast<int>(shape.num_q_heads);
  const int num_kv_heads = static_cast<int>(shape.num_kv_heads), head_dim = static_cast<int>(shape.head_dim);
  const int head = blockIdx.y, kv_head = head / (num_q_heads / num_kv_heads);
  // Later query tiles see more keys under the causal mask: start them first.
  const int first_query = (gridDim.x - 1 - blockIdx.x) * kQueryRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group_row = lane / 4, pair_col = 2 * (lane % 4);  // C fragment coordinates
  const fa::QueryRows rows = fa::query_rows(shape, first_query, kQueryRows, warp * 16, group_row);
  const int block_key_begin = rows.block_key_begin, block_key_end = rows.block_key_end;

  // Group 0: Q and the first K tile.
  fa::issue_tile_copy<kHeadDim, kStride>(q_tile, q, first_query, kQueryRows, num_tokens, num_q_heads, head, head_dim);
  fa::issue_tile_copy<kHeadDim, kStride>(k_tile, k, block_key_begin, kKeyRows, block_key_end, num_kv_heads, kv_head,
                                         head_dim);
  fa::cp_async_commit();

  float acc[kDimTiles][4];
  fa::zero_fragments(acc);
  float row_max[2] = {-INFINITY, -INFINITY};  // log2 units (scores times scale * log2 e)
  float row_sum[2] = {0.0f, 0.0f};            // this lane's share; the 4 lanes of a row add up at the end
  const float score_scale = shape.scale * fa::kLog2e;

  for (int key0 = block_key_begin; key0 < block_key_end; key0 += kKeyRows) {
    fa::cp_async_wait<0>();  // K(key0) (and Q) have landed for this thread
    __syncthreads();         // ... for every thread; and every warp is done with the previous V
    fa::issue_tile_copy<kHeadDim, kStride>(v_tile, v, key0, kKeyRows, block_key_end, num_kv_heads, kv_head,
                                           head_dim);
    fa::cp_async_commit();

    float score[kKeyTiles][4];
    fa::zero_fragments(score);
    fa::ldmatrix_rows_times_rows_t<kStride, kHeadDim / 16>(score, q_tile, warp * 16, k_tile, lane);
    fa::online_softmax_step(score, acc, row_max, row_sum, rows, key0, pair_col, score_scale);

    fa::cp_async_wait<0>();  // V(key0) has landed
    __syncthreads();         // ... for every thread; and every warp is done with K(key0)
    if (key0 + kKeyRows < block_key_end) {
      fa::issue_tile_copy<kHeadDim, kStride>(k_tile, k, key0 + kKeyRows, kKeyRows, block_key_end, num_kv_heads,
                                             kv_head, head_dim);
      fa::cp_async_commit();
    }

    // O += P V: the S accumulators of key tiles 2t and 2t+1 are the A fragment of k-step t.
    fa::ldmatrix_weights_times_tile<kStride>(acc, score, v_tile, lane);
  }

  fa::store_forward_rows(acc, row_max, row_sum, rows, num_tokens, num_q_heads, head, head_dim, lane, pair_col, out,
                         lse);
}

}  // namespace

bool flash_attention_wide_supported(const FlashAttentionShape& shape) {
  return shape.head_dim % 8 == 0 && shape.head_dim > 128 && shape.head_dim <= 256;
}

void flash_attention_forward_wide_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q,
                                       const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
                                       float* lse, cudaStream_t stream) {
  const char* where = "flash_attention_forward_wide_cuda";
  check_flash_attention_shape(shape, where);
  CHECK(flash_attention_wide_supported(shape), where, ": head dim ", shape.head_dim,
        " is not a multiple of 8 in (128, 256] (use flash_attention_forward_cuda, which falls back)");
  if (shape.num_tokens == 0) return;
  fa::check_forward_mma_pointers(q, k, v, out, lse, where);
  static_assert(kSharedBytes <= kSm80MaxSharedBytesPerBlock, "fits an sm_80 block (the sm_80 path)");
  allow_dynamic_shared_memory(forward_wide_kernel, kSharedBytes, "flash attention forward (wide)");
  const dim3 grid(static_cast<unsigned>((shape.num_tokens + kQueryRows - 1) / kQueryRows),
                  static_cast<unsigned>(shape.num_q_heads));
  forward_wide_kernel<<<grid, 32 * kWarps, kSharedBytes, stream>>>(shape, q, k, v, out, lse);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
