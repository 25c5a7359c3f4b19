// Tensor-core backward of packed-segment attention for head dims that are multiples of 8 up to 256
// (tiles padded to 64, 80, 128 or 256 columns), in the same two
// deterministic passes as the SIMT version (no atomics):
//   delta = rowsum(dO * O) per (token, query head);
//   dQ per (64-query tile, query head): S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K;
//   dK, dV per (64-key tile, KV head) over every query head of the group: S^T = K Q^T,
//     dP^T = V dO^T, dV += P^T dO, dK += dS^T Q. At D = 256 the dK/dV accumulators would not fit
//     the registers, so two blocks share a key tile, each accumulating one half of the head dim.
// All products on mma.sync m16n8k16 (bf16 in, fp32 accumulate); P and dS go to bf16 as A operands.
#include <cstdint>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/flash_attention/flash_attention_common.cuh"
#include "kernels/flash_attention/flash_attention_cuda.h"
#include "kernels/flash_attention/flash_attention_mma.cuh"

namespace deltamoe {
namespace {

namespace fa = flash_attention_detail;
using fa::load_column_pair;
using fa::load_pair;
using fa::load_tile;
using fa::mma_bf16_16x8x16;
using fa::pack_bf16;

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

// S (16 x 64 per warp) += A_rows . B_rows^T over the head dim, both row-major shared tiles: A rows
// are this warp's 16 rows, B rows the 64 columns of the result.
template <int kHeadDim>
__device__ inline void rows_times_rows_t(float (&c)[kColumnTiles][4], const uint16_t* a_rows,
                                         const uint16_t* b_tile, int group_row, int pair_col) {
  constexpr int kStride = kHeadDim + fa::kPad;
#pragma unroll
  for (int j = 0; j < kColumnTiles; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
#pragma unroll
  for (int s = 0; s < kHeadDim / 16; ++s) {
    const uint16_t* a = a_rows + group_row * kStride + 16 * s + pair_col;
    const uint32_t a0 = load_pair(a), a1 = load_pair(a + 8 * kStride);
    const uint32_t a2 = load_pair(a + 8), a3 = load_pair(a + 8 * kStride + 8);
#pragma unroll
    for (int j = 0; j < kColumnTiles; ++j) {
      const uint16_t* b = b_tile + (8 * j + group_row) * kStride + 16 * s + pair_col;
      mma_bf16_16x8x16(c[j], a0, a1, a2, a3, load_pair(b), load_pair(b + 8));
    }
  }
}

// acc (16 x kAccDim) += W . tile[:, first_col : first_col + kAccDim], W (16 x 64) given as C
// fragments (converted to bf16 A fragments here), tile a row-major shared [64, kHeadDim] tile.
template <int kHeadDim, int kAccDim>
__device__ inline void weights_times_tile(float (&acc)[kAccDim / 8][4], const float (&w)[kColumnTiles][4],
                                          const uint16_t* tile, int first_col, int group_row, int pair_col) {
  constexpr int kStride = kHeadDim + fa::kPad;
#pragma unroll
  for (int t = 0; t < kRows / 16; ++t) {
    const uint32_t a0 = pack_bf16(w[2 * t][0], w[2 * t][1]);
    const uint32_t a1 = pack_bf16(w[2 * t][2], w[2 * t][3]);
    const uint32_t a2 = pack_bf16(w[2 * t + 1][0], w[2 * t + 1][1]);
    const uint32_t a3 = pack_bf16(w[2 * t + 1][2], w[2 * t + 1][3]);
    const uint16_t* b = tile + (16 * t + pair_col) * kStride + first_col + group_row;
#pragma unroll
    for (int n = 0; n < kAccDim / 8; ++n) {
      const uint16_t* column = b + 8 * n;
      mma_bf16_16x8x16(acc[n], a0, a1, a2, a3, load_column_pair<kStride>(column),
                       load_column_pair<kStride>(column + 8 * kStride));
    }
  }
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
  const int num_segments = static_cast<int>(shape.num_segments);
  const int head = blockIdx.y, kv_head = head / (num_q_heads / num_kv_heads);
  const int first_query = (gridDim.x - 1 - blockIdx.x) * kRows;  // long causal rows first
  const int last_query = min(first_query + kRows, num_tokens) - 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group_row = lane / 4, pair_col = 2 * (lane % 4);

  int row_query[2], row_key_begin[2], row_key_limit[2];
  float row_lse[2], row_delta[2];  // lse in log2 units
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int query = first_query + warp * 16 + group_row + 8 * r;
    const bool valid = query < num_tokens;
    const fa::Segment segment = fa::find_segment(shape.cu_seqlens, num_segments, min(query, last_query));
    row_query[r] = query;
    row_key_begin[r] = segment.begin;
    row_key_limit[r] = !valid ? segment.begin : shape.causal ? query + 1 : segment.end;
    const int64_t stat = static_cast<int64_t>(valid ? query : last_query) * num_q_heads + head;
    row_lse[r] = lse[stat] * fa::kLog2e;
    row_delta[r] = delta[stat];
  }
  const int block_key_begin = fa::find_segment(shape.cu_seqlens, num_segments, first_query).begin;
  const int block_key_end =
      shape.causal ? last_query + 1 : fa::find_segment(shape.cu_seqlens, num_segments, last_query).end;

  load_tile<kHeadDim>(q_tile, q, first_query, kRows, num_tokens, num_q_heads, head, head_dim);
  load_tile<kHeadDim>(do_tile, d_out, first_query, kRows, num_tokens, num_q_heads, head, head_dim);
  const uint16_t* q_rows = q_tile + warp * 16 * kStride;
  const uint16_t* do_rows = do_tile + warp * 16 * kStride;
  const float score_scale = shape.scale * fa::kLog2e;

  float dq_acc[kHeadDim / 8][4];
#pragma unroll
  for (int n = 0; n < kHeadDim / 8; ++n) dq_acc[n][0] = dq_acc[n][1] = dq_acc[n][2] = dq_acc[n][3] = 0.0f;

  for (int key0 = block_key_begin; key0 < block_key_end; key0 += kRows) {
    __syncthreads();
    load_tile<kHeadDim>(k_tile, k, key0, kRows, block_key_end, num_kv_heads, kv_head, head_dim);
    load_tile<kHeadDim>(v_tile, v, key0, kRows, block_key_end, num_kv_heads, kv_head, head_dim);
    __syncthreads();
    float score[kColumnTiles][4], d_prob[kColumnTiles][4];
    rows_times_rows_t<kHeadDim>(score, q_rows, k_tile, group_row, pair_col);
    rows_times_rows_t<kHeadDim>(d_prob, do_rows, v_tile, group_row, pair_col);
#pragma unroll
    for (int j = 0; j < kColumnTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2, key = key0 + 8 * j + pair_col + (e % 2);
        const bool visible = key >= row_key_begin[r] && key < row_key_limit[r];
        const float p = visible ? exp2f(score[j][e] * score_scale - row_lse[r]) : 0.0f;
        score[j][e] = p * (d_prob[j][e] - row_delta[r]);  // dS, before the scale
      }
    }
    weights_times_tile<kHeadDim, kHeadDim>(dq_acc, score, k_tile, 0, group_row, pair_col);
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row_query[r] >= num_tokens) continue;
    __nv_bfloat16* dq_row = dq + (static_cast<int64_t>(row_query[r]) * num_q_heads + head) * head_dim + pair_col;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
      if (8 * n >= head_dim) break;  // padding columns are not stored (head_dim is a multiple of 8)
      *reinterpret_cast<__nv_bfloat162*>(dq_row + 8 * n) =
          __floats2bfloat162_rn(dq_acc[n][2 * r] * shape.scale, dq_acc[n][2 * r + 1] * shape.scale);
    }
  }
}

// Blocks per key tile in the dK/dV pass, each accumulating one slice of the head dim (S^T and
// dP^T are recomputed per slice): at D = 256 both accumulators together would not fit registers.
constexpr int dkv_splits(int head_dim) { return head_dim > 128 ? 2 : 1; }

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
  constexpr int kAccDim = kHeadDim / dkv_splits(kHeadDim);
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  uint16_t* k_tile = reinterpret_cast<uint16_t*>(shared_bytes);
  uint16_t* v_tile = k_tile + kRows * kStride;
  uint16_t* q_tile = v_tile + kRows * kStride;
  uint16_t* do_tile = q_tile + kRows * kStride;
  float* lse_tile = reinterpret_cast<float*>(do_tile + kRows * kStride);  // log2 units
  float* delta_tile = lse_tile + kRows;

  const int num_tokens = static_cast<int>(shape.num_tokens), num_q_heads = static_cast<int>(shape.num_q_heads);
  const int num_kv_heads = static_cast<int>(shape.num_kv_heads), head_dim = static_cast<int>(shape.head_dim);
  const int num_segments = static_cast<int>(shape.num_segments);
  const int group = num_q_heads / num_kv_heads;
  const int kv_head = blockIdx.y;
  const int first_key = blockIdx.x * kRows;  // early causal keys see the most queries: they come first
  const int last_key = min(first_key + kRows, num_tokens) - 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group_row = lane / 4, pair_col = 2 * (lane % 4);

  // Key j is seen by queries [causal ? j : segment.begin, segment.end); none for rows past T.
  int row_key[2], row_query_from[2], row_query_to[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = first_key + warp * 16 + group_row + 8 * r;
    const fa::Segment segment = fa::find_segment(shape.cu_seqlens, num_segments, min(key, last_key));
    row_key[r] = key;
    row_query_from[r] = shape.causal ? key : segment.begin;
    row_query_to[r] = key < num_tokens ? segment.end : 0;
  }
  const int block_query_begin =
      shape.causal ? first_key : fa::find_segment(shape.cu_seqlens, num_segments, first_key).begin;
  const int block_query_end = fa::find_segment(shape.cu_seqlens, num_segments, last_key).end;

  load_tile<kHeadDim>(k_tile, k, first_key, kRows, num_tokens, num_kv_heads, kv_head, head_dim);
  load_tile<kHeadDim>(v_tile, v, first_key, kRows, num_tokens, num_kv_heads, kv_head, head_dim);
  const uint16_t* k_rows = k_tile + warp * 16 * kStride;
  const uint16_t* v_rows = v_tile + warp * 16 * kStride;
  const float score_scale = shape.scale * fa::kLog2e;

  {
    const int first_col = blockIdx.z * kAccDim;  // this block's slice of the head dim
    float dk_acc[kAccDim / 8][4], dv_acc[kAccDim / 8][4];
#pragma unroll
    for (int n = 0; n < kAccDim / 8; ++n) {
      dk_acc[n][0] = dk_acc[n][1] = dk_acc[n][2] = dk_acc[n][3] = 0.0f;
      dv_acc[n][0] = dv_acc[n][1] = dv_acc[n][2] = dv_acc[n][3] = 0.0f;
    }
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
        rows_times_rows_t<kHeadDim>(prob, k_rows, q_tile, group_row, pair_col);
        rows_times_rows_t<kHeadDim>(d_score, v_rows, do_tile, group_row, pair_col);
#pragma unroll
        for (int j = 0; j < kColumnTiles; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e / 2, column = 8 * j + pair_col + (e % 2), query = query0 + column;
            const bool visible = query >= row_query_from[r] && query < row_query_to[r];
            const float p = visible ? exp2f(prob[j][e] * score_scale - lse_tile[column]) : 0.0f;
            prob[j][e] = p;
            d_score[j][e] = p * (d_score[j][e] - delta_tile[column]);
          }
        }
        weights_times_tile<kHeadDim, kAccDim>(dv_acc, prob, do_tile, first_col, group_row, pair_col);
        weights_times_tile<kHeadDim, kAccDim>(dk_acc, d_score, q_tile, first_col, group_row, pair_col);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (row_key[r] >= num_tokens) continue;
      const int64_t offset = (static_cast<int64_t>(row_key[r]) * num_kv_heads + kv_head) * head_dim + first_col +
                             pair_col;
#pragma unroll
      for (int n = 0; n < kAccDim / 8; ++n) {
        if (first_col + 8 * n >= head_dim) break;  // padding columns
        *reinterpret_cast<__nv_bfloat162*>(dk + offset + 8 * n) =
            __floats2bfloat162_rn(dk_acc[n][2 * r] * shape.scale, dk_acc[n][2 * r + 1] * shape.scale);
        *reinterpret_cast<__nv_bfloat162*>(dv + offset + 8 * n) =
            __floats2bfloat162_rn(dv_acc[n][2 * r], dv_acc[n][2 * r + 1]);
      }
    }
  }
}

template <int kHeadDim>
void launch_backward_mma(const FlashAttentionShape& shape, const __nv_bfloat16* q, const __nv_bfloat16* k,
                         const __nv_bfloat16* v, const float* lse, const __nv_bfloat16* d_out, const float* delta,
                         __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, cudaStream_t stream) {
  const unsigned tiles = static_cast<unsigned>((shape.num_tokens + kRows - 1) / kRows);
  constexpr size_t kDqShared = dq_shared_bytes<kHeadDim>(), kDkvShared = dkv_shared_bytes<kHeadDim>();
  CUDA_CHECK(cudaFuncSetAttribute(dq_mma_kernel<kHeadDim>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(kDqShared)));
  CUDA_CHECK(cudaFuncSetAttribute(dkv_mma_kernel<kHeadDim>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(kDkvShared)));
  dq_mma_kernel<kHeadDim><<<dim3(tiles, static_cast<unsigned>(shape.num_q_heads)), kThreads, kDqShared, stream>>>(
      shape, q, k, v, lse, d_out, delta, dq);
  CUDA_CHECK_LAUNCH();
  const dim3 dkv_grid(tiles, static_cast<unsigned>(shape.num_kv_heads), dkv_splits(kHeadDim));
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
        " is not a multiple of 8 (use flash_attention_backward_cuda, which falls back)");
  const size_t needed = flash_attention_backward_workspace_bytes(shape);
  CHECK(workspace_bytes >= needed, where, ": workspace of ", workspace_bytes, " bytes is smaller than the ", needed,
        " bytes needed (flash_attention_backward_workspace_bytes)");
  if (shape.num_tokens == 0) return;
  CHECK(q && k && v && out && lse && d_out && dq && dk && dv && workspace, where, ": null tensor or workspace pointer");
  for (const void* p : {static_cast<const void*>(q), static_cast<const void*>(k), static_cast<const void*>(v),
                        static_cast<const void*>(d_out)})
    CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, where, ": q, k, v and d_out must be 16-byte aligned");
  for (const void* p : {static_cast<const void*>(dq), static_cast<const void*>(dk), static_cast<const void*>(dv)})
    CHECK(reinterpret_cast<uintptr_t>(p) % 4 == 0, where, ": dq, dk and dv must be 4-byte aligned");
  float* delta = static_cast<float*>(workspace);
  const int64_t rows = shape.num_tokens * shape.num_q_heads;
  delta_kernel<<<static_cast<unsigned>((rows + fa::kRowsPerBlock - 1) / fa::kRowsPerBlock), fa::kThreadsPerBlock, 0,
                 stream>>>(out, d_out, rows, static_cast<int>(shape.head_dim), delta);
  CUDA_CHECK_LAUNCH();
  if (shape.head_dim <= 64) {  // tiles padded with zero columns, as in the forward
    launch_backward_mma<64>(shape, q, k, v, lse, d_out, delta, dq, dk, dv, stream);
  } else if (shape.head_dim <= 80) {
    launch_backward_mma<80>(shape, q, k, v, lse, d_out, delta, dq, dk, dv, stream);
  } else if (shape.head_dim <= 128) {
    launch_backward_mma<128>(shape, q, k, v, lse, d_out, delta, dq, dk, dv, stream);
  } else {
    launch_backward_mma<256>(shape, q, k, v, lse, d_out, delta, dq, dk, dv, stream);
  }
}

}  // namespace deltamoe
