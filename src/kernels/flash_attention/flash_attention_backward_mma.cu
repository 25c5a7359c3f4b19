// Tensor-core backward of packed-segment attention for head dims that are multiples of 8 up to 128
// (tiles padded to 64, 80 or 128 columns; wider heads take flash_attention_backward_wide.cu), in the same two
// deterministic passes as the SIMT version (no atomics):
//   delta = rowsum(dO * O) per (token, query head);
//   dQ per (64-query tile, query head): S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K;
//   dK, dV per (64-key tile, KV head) over every query head of the group: S^T = K Q^T,
//     dP^T = V dO^T, dV += P^T dO, dK += dS^T Q.
// All products on mma.sync m16n8k16 (bf16 in, fp32 accumulate); P and dS go to bf16 as A operands.
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
using fa::load_tile;

constexpr int kThreads = 32 * fa::kMmaWarps;
constexpr int kRows = fa::kTileRows;  // 64 rows per block and per tile
constexpr int kColumnTiles = kRows / 8;

// delta[t, h] = dO[t, h, :] . O[t, h, :], eight lanes per row.
__global__ void __launch_bounds__(fa::kThreadsPerBlock)
    delta_kernel(const __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ d_out, int64_t rows,
                 int head_dim, float* __restrict__ delta) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * fa::kRowsPerBlock + threadIdx.x / fa::kThreadsPerRow;
  const int lane = threadIdx.x % fa::kThreadsPerRow;
  float partial = 0.0f;
  if (row < rows) {
    for (int d = lane; d < head_dim; d += fa::kThreadsPerRow)
      partial += __bfloat162float(out[row * head_dim + d]) * __bfloat162float(d_out[row * head_dim + d]);
  }
  partial = fa::row_sum(partial);
  if (row < rows && lane == 0) delta[row] = partial;
}

template <int kHeadDim>
constexpr size_t dq_shared_bytes() {
  return static_cast<size_t>(4 * kRows) * (kHeadDim + fa::kPad) * sizeof(uint16_t);
}

template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    dq_mma_kernel(FlashAttentionShape shape, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                  const __nv_bfloat16* __restrict__ v, const float* __restrict__ lse,
                  const __nv_bfloat16* __restrict__ d_out, const float* __restrict__ delta,
                  __nv_bfloat16* __restrict__ dq) {
  constexpr int kStride = kHeadDim + fa::kPad;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(shared_bytes);
  uint16_t* do_tile = q_tile + kRows * kStride;
  uint16_t* k_tile = do_tile + kRows * kStride;
  uint16_t* v_tile = k_tile + kRows * kStride;

  const int num_tokens = static_cast<int>(shape.num_tokens), num_q_heads = static_cast<int>(shape.num_q_heads);
  const int num_kv_heads = static_cast<int>(shape.num_kv_heads), head_dim = static_cast<int>(shape.head_dim);
  const int head = blockIdx.y, kv_head = head / (num_q_heads / num_kv_heads);
  const int first_query = (gridDim.x - 1 - blockIdx.x) * kRows;  // long causal rows first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group_row = lane / 4, pair_col = 2 * (lane % 4);

  const fa::QueryRows rows = fa::query_rows(shape, first_query, kRows, warp * 16, group_row);
  const int block_key_begin = rows.block_key_begin, block_key_end = rows.block_key_end;
  float row_lse[2], row_delta[2];  // lse in log2 units
  fa::load_row_stats(row_lse, row_delta, rows, num_tokens, num_q_heads, head, lse, delta);

  load_tile<kHeadDim>(q_tile, q, first_query, kRows, num_tokens, num_q_heads, head, head_dim);
  load_tile<kHeadDim>(do_tile, d_out, first_query, kRows, num_tokens, num_q_heads, head, head_dim);
  const uint16_t* q_rows = q_tile + warp * 16 * kStride;
  const uint16_t* do_rows = do_tile + warp * 16 * kStride;
  const float score_scale = shape.scale * fa::kLog2e;

  float dq_acc[kHeadDim / 8][4];
  fa::zero_fragments(dq_acc);

  for (int key0 = block_key_begin; key0 < block_key_end; key0 += kRows) {
    __syncthreads();
    load_tile<kHeadDim>(k_tile, k, key0, kRows, block_key_end, num_kv_heads, kv_head, head_dim);
    load_tile<kHeadDim>(v_tile, v, key0, kRows, block_key_end, num_kv_heads, kv_head, head_dim);
    __syncthreads();
    float score[kColumnTiles][4], d_prob[kColumnTiles][4];
    fa::rows_times_rows_t<kHeadDim>(score, q_rows, k_tile, group_row, pair_col);
    fa::rows_times_rows_t<kHeadDim>(d_prob, do_rows, v_tile, group_row, pair_col);
    fa::dscore_step(score, d_prob, rows, row_lse, row_delta, key0, pair_col, score_scale);
    fa::weights_times_tile<kHeadDim, kHeadDim>(dq_acc, score, k_tile, 0, group_row, pair_col);
  }

  fa::store_dq_rows(dq_acc, rows, num_tokens, num_q_heads, head, head_dim, pair_col, shape.scale, dq);
}

template <int kHeadDim>
constexpr size_t dkv_shared_bytes() {
  return static_cast<size_t>(4 * kRows) * (kHeadDim + fa::kPad) * sizeof(uint16_t) + 2 * kRows * sizeof(float);
}

template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    dkv_mma_kernel(FlashAttentionShape shape, const __nv_bfloat16* __restrict__ q,
                   const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
                   const float* __restrict__ lse, const __nv_bfloat16* __restrict__ d_out,
                   const float* __restrict__ delta, __nv_bfloat16* __restrict__ dk, __nv_bfloat16* __restrict__ dv) {
  constexpr int kStride = kHeadDim + fa::kPad;
  constexpr int kAccDim = kHeadDim;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  uint16_t* k_tile = reinterpret_cast<uint16_t*>(shared_bytes);
  uint16_t* v_tile = k_tile + kRows * kStride;
  uint16_t* q_tile = v_tile + kRows * kStride;
  uint16_t* do_tile = q_tile + kRows * kStride;
  float* lse_tile = reinterpret_cast<float*>(do_tile + kRows * kStride);  // log2 units
  float* delta_tile = lse_tile + kRows;

  const int num_tokens = static_cast<int>(shape.num_tokens), num_q_heads = static_cast<int>(shape.num_q_heads);
  const int num_kv_heads = static_cast<int>(shape.num_kv_heads), head_dim = static_cast<int>(shape.head_dim);
  const int group = num_q_heads / num_kv_heads;
  const int kv_head = blockIdx.y;
  const int first_key = blockIdx.x * kRows;  // early causal keys see the most queries: they come first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group_row = lane / 4, pair_col = 2 * (lane % 4);

  const fa::KeyRows rows = fa::key_rows(shape, first_key, kRows, warp * 16, group_row);
  const int block_query_begin = rows.block_query_begin, block_query_end = rows.block_query_end;

  load_tile<kHeadDim>(k_tile, k, first_key, kRows, num_tokens, num_kv_heads, kv_head, head_dim);
  load_tile<kHeadDim>(v_tile, v, first_key, kRows, num_tokens, num_kv_heads, kv_head, head_dim);
  const uint16_t* k_rows = k_tile + warp * 16 * kStride;
  const uint16_t* v_rows = v_tile + warp * 16 * kStride;
  const float score_scale = shape.scale * fa::kLog2e;

  {
    const int first_col = 0;
    float dk_acc[kAccDim / 8][4], dv_acc[kAccDim / 8][4];
    fa::zero_fragments(dk_acc);
    fa::zero_fragments(dv_acc);
    for (int head = kv_head * group; head < (kv_head + 1) * group; ++head) {
      for (int query0 = block_query_begin; query0 < block_query_end; query0 += kRows) {
        __syncthreads();  // previous Q/dO tile no longer read (and K/V complete on the first pass)
        load_tile<kHeadDim>(q_tile, q, query0, kRows, block_query_end, num_q_heads, head, head_dim);
        load_tile<kHeadDim>(do_tile, d_out, query0, kRows, block_query_end, num_q_heads, head, head_dim);
        for (int i = threadIdx.x; i < kRows; i += blockDim.x) {
          const int query = query0 + i;
          const bool valid = query < block_query_end;
          lse_tile[i] = valid ? lse[static_cast<int64_t>(query) * num_q_heads + head] * fa::kLog2e : 0.0f;
          delta_tile[i] = valid ? delta[static_cast<int64_t>(query) * num_q_heads + head] : 0.0f;
        }
        __syncthreads();
        float prob[kColumnTiles][4], d_score[kColumnTiles][4];  // rows: keys, columns: queries
        fa::rows_times_rows_t<kHeadDim>(prob, k_rows, q_tile, group_row, pair_col);
        fa::rows_times_rows_t<kHeadDim>(d_score, v_rows, do_tile, group_row, pair_col);
#pragma unroll
        for (int j = 0; j < kColumnTiles; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e / 2, column = 8 * j + pair_col + (e % 2), query = query0 + column;
            const bool visible = query >= rows.query_from[r] && query < rows.query_to[r];
            const float p = visible ? exp2f(prob[j][e] * score_scale - lse_tile[column]) : 0.0f;
            prob[j][e] = p;
            d_score[j][e] = p * (d_score[j][e] - delta_tile[column]);
          }
        }
        fa::weights_times_tile<kHeadDim, kAccDim>(dv_acc, prob, do_tile, first_col, group_row, pair_col);
        fa::weights_times_tile<kHeadDim, kAccDim>(dk_acc, d_score, q_tile, first_col, group_row, pair_col);
      }
    }
    fa::store_dk_dv_rows(dk_acc, dv_acc, rows.key, num_tokens, num_kv_heads, kv_head, head_dim, first_col, pair_col,
                         shape.scale, dk, dv);
  }
}

template <int kHeadDim>
void launch_backward_mma(const FlashAttentionShape& shape, const __nv_bfloat16* q, const __nv_bfloat16* k,
                         const __nv_bfloat16* v, const float* lse, const __nv_bfloat16* d_out, const float* delta,
                         __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, cudaStream_t stream) {
  const unsigned tiles = static_cast<unsigned>((shape.num_tokens + kRows - 1) / kRows);
  constexpr size_t kDqShared = dq_shared_bytes<kHeadDim>(), kDkvShared = dkv_shared_bytes<kHeadDim>();
  static_assert(kDqShared <= kSm80MaxSharedBytesPerBlock, "fits an sm_80 block (the sm_80 path)");
  allow_dynamic_shared_memory(dq_mma_kernel<kHeadDim>, kDqShared, "flash attention backward (mma)");
  static_assert(kDkvShared <= kSm80MaxSharedBytesPerBlock, "fits an sm_80 block (the sm_80 path)");
  allow_dynamic_shared_memory(dkv_mma_kernel<kHeadDim>, kDkvShared, "flash attention backward (mma)");
  dq_mma_kernel<kHeadDim><<<dim3(tiles, static_cast<unsigned>(shape.num_q_heads)), kThreads, kDqShared, stream>>>(
      shape, q, k, v, lse, d_out, delta, dq);
  CUDA_CHECK_LAUNCH();
  const dim3 dkv_grid(tiles, static_cast<unsigned>(shape.num_kv_heads));
  dkv_mma_kernel<kHeadDim><<<dkv_grid, kThreads, kDkvShared, stream>>>(shape, q, k, v, lse, d_out, delta, dk, dv);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool flash_attention_backward_mma_supported(const FlashAttentionShape& shape) {
  return flash_attention_forward_mma_supported(shape);
}

void flash_attention_backward_mma_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q,
                                       const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* out,
                                       const float* lse, const __nv_bfloat16* d_out, __nv_bfloat16* dq,
                                       __nv_bfloat16* dk, __nv_bfloat16* dv, void* workspace, size_t workspace_bytes,
                                       cudaStream_t stream) {
  const char* where = "flash_attention_backward_mma_cuda";
  check_flash_attention_shape(shape, where);
  CHECK(flash_attention_backward_mma_supported(shape), where, ": head dim ", shape.head_dim,
        " is not a multiple of 8 up to ", kFlashAttentionMmaMaxHeadDim, " (use flash_attention_backward_cuda, which dispatches)");
  fa::check_backward_workspace(shape, workspace_bytes, where);
  if (shape.num_tokens == 0) return;
  fa::check_backward_mma_pointers(q, k, v, out, lse, d_out, dq, dk, dv, workspace, where);
  float* delta = static_cast<float*>(workspace);
  const int64_t rows = shape.num_tokens * shape.num_q_heads;
  delta_kernel<<<static_cast<unsigned>((rows + fa::kRowsPerBlock - 1) / fa::kRowsPerBlock), fa::kThreadsPerBlock, 0,
                 stream>>>(out, d_out, rows, static_cast<int>(shape.head_dim), delta);
  CUDA_CHECK_LAUNCH();
  if (shape.head_dim <= 64) {  // tiles padded with zero columns, as in the forward
    launch_backward_mma<64>(shape, q, k, v, lse, d_out, delta, dq, dk, dv, stream);
  } else if (shape.head_dim <= 80) {
    launch_backward_mma<80>(shape, q, k, v, lse, d_out, delta, dq, dk, dv, stream);
  } else {
    launch_backward_mma<128>(shape, q, k, v, lse, d_out, delta, dq, dk, dv, stream);
  }
}

}  // namespace deltamoe
