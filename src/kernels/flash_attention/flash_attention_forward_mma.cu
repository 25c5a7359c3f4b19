// Tensor-core forward of packed-segment attention (FlashAttention-2 layout) for head dims that are
// multiples of 8 up to 128 (tiles padded to 64, 80 or 128 columns; wider heads take
// flash_attention_forward_wide.cu): a block of 4 warps owns
// 64 queries of one head (16 per warp); 64-key K/V tiles pass through shared memory; S = Q K^T and O += P V run on mma.sync m16n8k16 (bf16 in, fp32 out); the
// online softmax stays in fp32 registers, P is handed from the S accumulators to the A operand
// without touching shared memory. Works on sm_80 and sm_90a.
#include <cstdint>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/kernel_path_cuda.h"
#include "kernels/flash_attention/flash_attention_common.cuh"
#include "kernels/flash_attention/flash_attention_cuda.h"
#include "kernels/flash_attention/flash_attention_launch_checks.h"
#include "kernels/flash_attention/flash_attention_mma.cuh"
#include "kernels/flash_attention/flash_attention_rows.cuh"

namespace deltamoe {
namespace {

namespace fa = flash_attention_detail;

constexpr int kWarps = fa::kMmaWarps;
constexpr int kQueryRows = fa::kTileRows;  // queries per block
constexpr int kKeyRows = fa::kTileRows;    // keys per tile
constexpr int kPad = fa::kPad;
constexpr float kLog2e = fa::kLog2e;
using fa::load_tile;

template <int kHeadDim>
constexpr size_t shared_bytes_for() {
  return static_cast<size_t>(kQueryRows + 2 * kKeyRows) * (kHeadDim + kPad) * sizeof(uint16_t);
}

template <int kHeadDim>
__global__ void __launch_bounds__(32 * kWarps)
    forward_mma_kernel(FlashAttentionShape shape, const __nv_bfloat16* __restrict__ q,
                       const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
                       __nv_bfloat16* __restrict__ out, float* __restrict__ lse) {
  constexpr int kStride = kHeadDim + kPad;
  constexpr int kDimTiles = kHeadDim / 8;   // n-tiles of O
  constexpr int kKeyTiles = kKeyRows / 8;   // n-tiles of S
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
  const int group_row = lane / 4, pair_col = 2 * (lane % 4);  // fragment coordinates
  // This thread's two rows: warp * 16 + group_row and + 8.
  const fa::QueryRows rows = fa::query_rows(shape, first_query, kQueryRows, warp * 16, group_row);
  const int block_key_begin = rows.block_key_begin, block_key_end = rows.block_key_end;

  load_tile<kHeadDim>(q_tile, q, first_query, kQueryRows, num_tokens, num_q_heads, head, head_dim);

  float acc[kDimTiles][4];
  fa::zero_fragments(acc);
  float row_max[2] = {-INFINITY, -INFINITY};  // in log2 units (scores times scale * log2 e)
  float row_sum[2] = {0.0f, 0.0f};            // this lane's share; the 4 lanes of a row add up at the end
  const float score_scale = shape.scale * kLog2e;
  const uint16_t* q_rows = q_tile + warp * 16 * kStride;

  for (int key0 = block_key_begin; key0 < block_key_end; key0 += kKeyRows) {
    __syncthreads();  // previous K/V tile no longer read (and the Q tile is complete on the first pass)
    load_tile<kHeadDim>(k_tile, k, key0, kKeyRows, block_key_end, num_kv_heads, kv_head, head_dim);
    load_tile<kHeadDim>(v_tile, v, key0, kKeyRows, block_key_end, num_kv_heads, kv_head, head_dim);
    __syncthreads();

    float score[kKeyTiles][4];
    fa::rows_times_rows_t<kHeadDim>(score, q_rows, k_tile, group_row, pair_col);
    fa::online_softmax_step(score, acc, row_max, row_sum, rows, key0, pair_col, score_scale);
    // O += P V: the S accumulators of key tiles 2t and 2t+1 are the A fragment of k-step t.
    fa::weights_times_tile<kHeadDim, kHeadDim>(acc, score, v_tile, 0, group_row, pair_col);
  }

  fa::store_forward_rows(acc, row_max, row_sum, rows, num_tokens, num_q_heads, head, head_dim, lane, pair_col, out,
                         lse);
}

template <int kHeadDim>
void launch_forward_mma(const FlashAttentionShape& shape, const __nv_bfloat16* q, const __nv_bfloat16* k,
                        const __nv_bfloat16* v, __nv_bfloat16* out, float* lse, cudaStream_t stream) {
  constexpr size_t kShared = shared_bytes_for<kHeadDim>();
  static_assert(kShared <= kSm80MaxSharedBytesPerBlock, "fits an sm_80 block (the sm_80 path)");
  allow_dynamic_shared_memory(forward_mma_kernel<kHeadDim>, kShared, "flash attention forward (mma)");
  const dim3 grid(static_cast<unsigned>((shape.num_tokens + kQueryRows - 1) / kQueryRows),
                  static_cast<unsigned>(shape.num_q_heads));
  forward_mma_kernel<kHeadDim><<<grid, 32 * kWarps, kShared, stream>>>(shape, q, k, v, out, lse);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool flash_attention_forward_mma_supported(const FlashAttentionShape& shape) {
  return shape.head_dim % 8 == 0 && shape.head_dim >= 8 && shape.head_dim <= kFlashAttentionMmaMaxHeadDim;
}

void flash_attention_forward_mma_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q,
                                      const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out, float* lse,
                                      cudaStream_t stream) {
  const char* where = "flash_attention_forward_mma_cuda";
  check_flash_attention_shape(shape, where);
  CHECK(flash_attention_forward_mma_supported(shape), where, ": head dim ", shape.head_dim,
        " is not a multiple of 8 up to ", kFlashAttentionMmaMaxHeadDim, " (use flash_attention_forward_cuda, which dispatches)");
  if (shape.num_tokens == 0) return;
  // 16-byte loads of head rows need 16-byte aligned tensors.
  fa::check_forward_mma_pointers(q, k, v, out, lse, where);
  // Tiles are padded with zero columns to the next instantiated width (72 -> 80 for the vision tower).
  if (shape.head_dim <= 64) {
    launch_forward_mma<64>(shape, q, k, v, out, lse, stream);
  } else if (shape.head_dim <= 80) {
    launch_forward_mma<80>(shape, q, k, v, out, lse, stream);
  } else {
    launch_forward_mma<128>(shape, q, k, v, out, lse, stream);
  }
}

}  // namespace deltamoe
