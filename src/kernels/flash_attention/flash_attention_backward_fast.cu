// Pipelined tensor-core backward of packed-segment attention for head dims in (128, 256] that are
// multiples of 8, in two deterministic passes (no atomics, no workspace beyond delta):
//   delta = rowsum(dO * O), one warp per (token, query head);
//   dQ pass, per (64-query tile, query head), 4 warps of 16 queries: 32-key K/V tiles by cp.async
//     (V(j+1) loads during S, dS and dQ += dS K; K(j+1) during dP = dO V^T), ldmatrix operands;
//   dK/dV pass, per (64-key tile, KV head), 8 warps: each warp computes S^T and dP^T for 16 keys x
//     16 of the 32 queries of a Q/dO tile (double-buffered by cp.async) over the whole head dim,
//     P^T and dS^T meet in shared memory, then each warp accumulates dV += P^T dO and dK += dS^T Q
//     for its 16 keys and one half of D in registers: one pass over D = 256, no recomputation.
//     A block takes key tiles i and n-1-i so that causal blocks carry equal work (one wave).
#include <cstdint>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/flash_attention/flash_attention_common.cuh"
#include "kernels/flash_attention/flash_attention_cuda.h"
#include "kernels/flash_attention/flash_attention_mma.cuh"
#include "kernels/flash_attention/flash_attention_pipeline.cuh"

namespace deltamoe {
namespace {

namespace fa = flash_attention_detail;

constexpr int kHeadDim = 256;  // padded width of the tiles
constexpr int kStride = kHeadDim + fa::kPad;

// delta[row] = dO[row, :] . O[row, :] over rows = (token, query head), one warp per row with
// 16-byte loads (head_dim a multiple of 8, rows 16-byte aligned).
__global__ void __launch_bounds__(256)
    delta_fast_kernel(const __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ d_out, int64_t rows,
                      int head_dim, float* __restrict__ delta) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float partial = 0.0f;
  for (int vec = lane; vec * 8 < head_dim; vec += 32) {
    const uint4 o = *reinterpret_cast<const uint4*>(out + row * head_dim + vec * 8);
    const uint4 g = *reinterpret_cast<const uint4*>(d_out + row * head_dim + vec * 8);
    const __nv_bfloat162* o2 = reinterpret_cast<const __nv_bfloat162*>(&o);
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&g);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 of = __bfloat1622float2(o2[i]), gf = __bfloat1622float2(g2[i]);
      partial += of.x * gf.x + of.y * gf.y;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) partial += __shfl_xor_sync(0xffffffffu, partial, offset);
  if (lane == 0) delta[row] = partial;
}

// ---- dQ pass ----
constexpr int kDqWarps = 4;
constexpr int kDqQueryRows = 16 * kDqWarps;
constexpr int kDqKeyRows = 32;
// Q, dO (64 rows each), K and V (32 rows each): 99 KB, two blocks per H100 SM.
constexpr size_t kDqSharedBytes =
    static_cast<size_t>(2 * kDqQueryRows + 2 * kDqKeyRows) * kStride * sizeof(uint16_t);

__global__ void __launch_bounds__(32 * kDqWarps, 2)
    dq_fast_kernel(FlashAttentionShape shape, const __nv_bfloat16* __restrict__ q,
                   const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
                   const float* __restrict__ lse, const __nv_bfloat16* __restrict__ d_out,
                   const float* __restrict__ delta, __nv_bfloat16* __restrict__ dq) {
  constexpr int kKeyTiles = kDqKeyRows / 8;
  constexpr int kDimTiles = kHeadDim / 8;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(shared_bytes);
  uint16_t* do_tile = q_tile + kDqQueryRows * kStride;
  uint16_t* k_tile = do_tile + kDqQueryRows * kStride;
  uint16_t* v_tile = k_tile + kDqKeyRows * kStride;

  const int num_tokens = static_cast<int>(shape.num_tokens), num_q_heads = static_cast<int>(shape.num_q_heads);
  const int num_kv_heads = static_cast<int>(shape.num_kv_heads), head_dim = static_cast<int>(shape.head_dim);
  const int num_segments = static_cast<int>(shape.num_segments);
  const int head = blockIdx.y, kv_head = head / (num_q_heads / num_kv_heads);
  const int first_query = (gridDim.x - 1 - blockIdx.x) * kDqQueryRows;  // long causal rows first
  const int last_query = min(first_query + kDqQueryRows, num_tokens) - 1;
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

  // Group order: {Q, dO, V(0)}, {K(0)}; then per step {V(j+1)}, {K(j+1)}.
  fa::issue_tile_copy<kHeadDim, kStride>(q_tile, q, first_query, kDqQueryRows, num_tokens, num_q_heads, head,
                                         head_dim);
  fa::issue_tile_copy<kHeadDim, kStride>(do_tile, d_out, first_query, kDqQueryRows, num_tokens, num_q_heads, head,
                                         head_dim);
  fa::issue_tile_copy<kHeadDim, kStride>(v_tile, v, block_key_begin, kDqKeyRows, block_key_end, num_kv_heads,
                                         kv_head, head_dim);
  fa::cp_async_commit();
  fa::issue_tile_copy<kHeadDim, kStride>(k_tile, k, block_key_begin, kDqKeyRows, block_key_end, num_kv_heads,
                                         kv_head, head_dim);
  fa::cp_async_commit();

  const float score_scale = shape.scale * fa::kLog2e;
  float dq_acc[kDimTiles][4];
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) dq_acc[n][0] = dq_acc[n][1] = dq_acc[n][2] = dq_acc[n][3] = 0.0f;

  for (int key0 = block_key_begin; key0 < block_key_end; key0 += kDqKeyRows) {
    const bool has_next = key0 + kDqKeyRows < block_key_end;
    fa::cp_async_wait<1>();  // V(j) (and Q, dO) landed; K(j) may still be in flight
    __syncthreads();

    float d_prob[kKeyTiles][4], score[kKeyTiles][4];
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
      d_prob[j][0] = d_prob[j][1] = d_prob[j][2] = d_prob[j][3] = 0.0f;
      score[j][0] = score[j][1] = score[j][2] = score[j][3] = 0.0f;
    }
#pragma unroll
    for (int s = 0; s < kHeadDim / 16; ++s) {  // dP = dO V^T
      uint32_t a[4];
      fa::load_a_fragment<kStride>(a, do_tile, warp * 16, 16 * s, lane);
#pragma unroll
      for (int jj = 0; jj < kKeyTiles / 2; ++jj) {
        uint32_t b[4];
        fa::load_b_fragments_from_rows<kStride>(b, v_tile, 16 * jj, 16 * s, lane);
        fa::mma_bf16_16x8x16(d_prob[2 * jj], a[0], a[1], a[2], a[3], b[0], b[1]);
        fa::mma_bf16_16x8x16(d_prob[2 * jj + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
      }
    }

    fa::cp_async_wait<0>();  // K(j) landed
    __syncthreads();         // ... for all threads; every warp is done with V(j)
    if (has_next) {
      fa::issue_tile_copy<kHeadDim, kStride>(v_tile, v, key0 + kDqKeyRows, kDqKeyRows, block_key_end, num_kv_heads,
                                             kv_head, head_dim);
      fa::cp_async_commit();
    }

#pragma unroll
    for (int s = 0; s < kHeadDim / 16; ++s) {  // S = Q K^T
      uint32_t a[4];
      fa::load_a_fragment<kStride>(a, q_tile, warp * 16, 16 * s, lane);
#pragma unroll
      for (int jj = 0; jj < kKeyTiles / 2; ++jj) {
        uint32_t b[4];
        fa::load_b_fragments_from_rows<kStride>(b, k_tile, 16 * jj, 16 * s, lane);
        fa::mma_bf16_16x8x16(score[2 * jj], a[0], a[1], a[2], a[3], b[0], b[1]);
        fa::mma_bf16_16x8x16(score[2 * jj + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
      }
    }
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2, key = key0 + 8 * j + pair_col + (e % 2);
        const bool visible = key >= row_key_begin[r] && key < row_key_limit[r];
        const float p = visible ? exp2f(score[j][e] * score_scale - row_lse[r]) : 0.0f;
        score[j][e] = p * (d_prob[j][e] - row_delta[r]);  // dS, before the scale
      }
    }
    // dQ += dS K: the dS accumulators of key tiles 2t, 2t+1 are the A fragment of k-step t.
#pragma unroll
    for (int t = 0; t < kDqKeyRows / 16; ++t) {
      const uint32_t a0 = fa::pack_bf16(score[2 * t][0], score[2 * t][1]);
      const uint32_t a1 = fa::pack_bf16(score[2 * t][2], score[2 * t][3]);
      const uint32_t a2 = fa::pack_bf16(score[2 * t + 1][0], score[2 * t + 1][1]);
      const uint32_t a3 = fa::pack_bf16(score[2 * t + 1][2], score[2 * t + 1][3]);
#pragma unroll
      for (int nn = 0; nn < kDimTiles / 2; ++nn) {
        uint32_t b[4];
        fa::load_b_fragments_from_columns<kStride>(b, k_tile, 16 * t, 16 * nn, lane);
        fa::mma_bf16_16x8x16(dq_acc[2 * nn], a0, a1, a2, a3, b[0], b[1]);
        fa::mma_bf16_16x8x16(dq_acc[2 * nn + 1], a0, a1, a2, a3, b[2], b[3]);
      }
    }

    if (has_next) {
      __syncthreads();  // every warp is done with K(j)
      fa::issue_tile_copy<kHeadDim, kStride>(k_tile, k, key0 + kDqKeyRows, kDqKeyRows, block_key_end, num_kv_heads,
                                             kv_head, head_dim);
      fa::cp_async_commit();
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row_query[r] >= num_tokens) continue;
    __nv_bfloat16* dq_row = dq + (static_cast<int64_t>(row_query[r]) * num_q_heads + head) * head_dim + pair_col;
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      if (8 * n >= head_dim) break;  // padding columns are not stored
      *reinterpret_cast<__nv_bfloat162*>(dq_row + 8 * n) =
          __floats2bfloat162_rn(dq_acc[n][2 * r] * shape.scale, dq_acc[n][2 * r + 1] * shape.scale);
    }
  }
}

// ---- dK/dV pass ----
constexpr int kDkvWarps = 8;
constexpr int kDkvKeyRows = 64;    // 4 key groups of 16 rows
constexpr int kDkvQueryRows = 32;  // 2 query halves of 16
constexpr int kHalfDim = kHeadDim / 2;
constexpr int kProbStride = kDkvQueryRows + fa::kPad;  // P^T / dS^T rows: 80 bytes, conflict-free ldmatrix
// K, V (64 rows each), two buffers of Q and dO (32 rows each), P^T and dS^T, lse and delta.
constexpr size_t kDkvSharedBytes =
    static_cast<size_t>(2 * kDkvKeyRows + 4 * kDkvQueryRows) * kStride * sizeof(uint16_t) +
    static_cast<size_t>(2 * kDkvKeyRows) * kProbStride * sizeof(uint16_t) + 4 * kDkvQueryRows * sizeof(float);

__global__ void __launch_bounds__(32 * kDkvWarps, 1)
    dkv_fast_kernel(FlashAttentionShape shape, const __nv_bfloat16* __restrict__ q,
                    const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
                    const float* __restrict__ lse, const __nv_bfloat16* __restrict__ d_out,
                    const float* __restrict__ delta, __nv_bfloat16* __restrict__ dk, __nv_bfloat16* __restrict__ dv) {
  constexpr int kAccTiles = kHalfDim / 8;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  uint16_t* k_tile = reinterpret_cast<uint16_t*>(shared_bytes);
  uint16_t* v_tile = k_tile + kDkvKeyRows * kStride;
  uint16_t* q_buffers = v_tile + kDkvKeyRows * kStride;             // [2][32 rows]
  uint16_t* do_buffers = q_buffers + 2 * kDkvQueryRows * kStride;   // [2][32 rows]
  uint16_t* prob_tile = do_buffers + 2 * kDkvQueryRows * kStride;   // P^T [64 keys][32 queries]
  uint16_t* dscore_tile = prob_tile + kDkvKeyRows * kProbStride;    // dS^T
  float* lse_buffers = reinterpret_cast<float*>(dscore_tile + kDkvKeyRows * kProbStride);  // [2][32], natural log
  float* delta_buffers = lse_buffers + 2 * kDkvQueryRows;                                  // [2][32]

  const int num_tokens = static_cast<int>(shape.num_tokens), num_q_heads = static_cast<int>(shape.num_q_heads);
  const int num_kv_heads = static_cast<int>(shape.num_kv_heads), head_dim = static_cast<int>(shape.head_dim);
  const int num_segments = static_cast<int>(shape.num_segments);
  const int group = num_q_heads / num_kv_heads;
  const int kv_head = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int key_group = warp % 4, half = warp / 4;  // rows 16 * key_group; query half / D half
  const int group_row = lane / 4, pair_col = 2 * (lane % 4);
  const float score_scale = shape.scale * fa::kLog2e;
  const int num_key_tiles = (num_tokens + kDkvKeyRows - 1) / kDkvKeyRows;

  for (int pass = 0; pass < 2; ++pass) {
    // Causal work of a key tile falls with its position; pairing i with n-1-i evens it out.
    const int tile = pass == 0 ? static_cast<int>(blockIdx.x) : num_key_tiles - 1 - static_cast<int>(blockIdx.x);
    if (pass == 1 && tile == static_cast<int>(blockIdx.x)) break;  // odd count: the middle tile once
    const int first_key = tile * kDkvKeyRows;
    const int last_key = min(first_key + kDkvKeyRows, num_tokens) - 1;

    // Key j is seen by queries [causal ? j : segment.begin, segment.end); none for rows past T.
    int row_query_from[2], row_query_to[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = first_key + key_group * 16 + group_row + 8 * r;
      const fa::Segment segment = fa::find_segment(shape.cu_seqlens, num_segments, min(key, last_key));
      row_query_from[r] = shape.causal ? key : segment.begin;
      row_query_to[r] = key < num_tokens ? segment.end : 0;
    }
    const int block_query_begin =
        shape.causal ? first_key : fa::find_segment(shape.cu_seqlens, num_segments, first_key).begin;
    const int block_query_end = fa::find_segment(shape.cu_seqlens, num_segments, last_key).end;
    const int query_tiles = (block_query_end - block_query_begin + kDkvQueryRows - 1) / kDkvQueryRows;
    const int steps = group * query_tiles;  // (query head, query tile) pairs, >= 1

    // Loads of step `step` into buffer step % 2: Q, dO, lse, delta rows of one query head.
    auto issue_step = [&](int step) {
      const int head = kv_head * group + step / query_tiles;
      const int query0 = block_query_begin + (step % query_tiles) * kDkvQueryRows;
      const int buffer = step % 2;
      fa::issue_tile_copy<kHeadDim, kStride>(q_buffers + buffer * kDkvQueryRows * kStride, q, query0, kDkvQueryRows,
                                             block_query_end, num_q_heads, head, head_dim);
      fa::issue_tile_copy<kHeadDim, kStride>(do_buffers + buffer * kDkvQueryRows * kStride, d_out, query0,
                                             kDkvQueryRows, block_query_end, num_q_heads, head, head_dim);
      if (threadIdx.x < 2 * kDkvQueryRows) {
        const int i = threadIdx.x % kDkvQueryRows, query = query0 + i;
        const bool valid = query < block_query_end;
        const int64_t stat = valid ? static_cast<int64_t>(query) * num_q_heads + head : 0;
        if (threadIdx.x < kDkvQueryRows) {
          fa::cp_async_4(lse_buffers + buffer * kDkvQueryRows + i, lse + stat, valid);
        } else {
          fa::cp_async_4(delta_buffers + buffer * kDkvQueryRows + i, delta + stat, valid);
        }
      }
    };

    fa::issue_tile_copy<kHeadDim, kStride>(k_tile, k, first_key, kDkvKeyRows, num_tokens, num_kv_heads, kv_head,
                                           head_dim);
    fa::issue_tile_copy<kHeadDim, kStride>(v_tile, v, first_key, kDkvKeyRows, num_tokens, num_kv_heads, kv_head,
                                           head_dim);
    issue_step(0);
    fa::cp_async_commit();

    float dk_acc[kAccTiles][4], dv_acc[kAccTiles][4];
#pragma unroll
    for (int n = 0; n < kAccTiles; ++n) {
      dk_acc[n][0] = dk_acc[n][1] = dk_acc[n][2] = dk_acc[n][3] = 0.0f;
      dv_acc[n][0] = dv_acc[n][1] = dv_acc[n][2] = dv_acc[n][3] = 0.0f;
    }

    for (int step = 0; step < steps; ++step) {
      if (step + 1 < steps) {
        issue_step(step + 1);  // the other buffer: freed by the barrier that ended the previous step
        fa::cp_async_commit();
        fa::cp_async_wait<1>();
      } else {
        fa::cp_async_wait<0>();
      }
      __syncthreads();  // step's Q/dO/lse/delta (and K/V) visible to every thread
      const int buffer = step % 2;
      const uint16_t* q_tile = q_buffers + buffer * kDkvQueryRows * kStride;
      const uint16_t* do_tile = do_buffers + buffer * kDkvQueryRows * kStride;
      const float* lse_tile = lse_buffers + buffer * kDkvQueryRows;
      const float* delta_tile = delta_buffers + buffer * kDkvQueryRows;
      const int query0 = block_query_begin + (step % query_tiles) * kDkvQueryRows;

      // S^T and dP^T for this warp's 16 keys x 16 queries (half), over the whole head dim.
      float prob[2][4], d_score[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        prob[j][0] = prob[j][1] = prob[j][2] = prob[j][3] = 0.0f;
        d_score[j][0] = d_score[j][1] = d_score[j][2] = d_score[j][3] = 0.0f;
      }
#pragma unroll 4  // fully unrolled, the loads hoisted for latency push the 128 accumulators to spill
      for (int s = 0; s < kHeadDim / 16; ++s) {
        uint32_t a[4], b[4];
        fa::load_a_fragment<kStride>(a, k_tile, key_group * 16, 16 * s, lane);
        fa::load_b_fragments_from_rows<kStride>(b, q_tile, 16 * half, 16 * s, lane);
        fa::mma_bf16_16x8x16(prob[0], a[0], a[1], a[2], a[3], b[0], b[1]);
        fa::mma_bf16_16x8x16(prob[1], a[0], a[1], a[2], a[3], b[2], b[3]);
        fa::load_a_fragment<kStride>(a, v_tile, key_group * 16, 16 * s, lane);
        fa::load_b_fragments_from_rows<kStride>(b, do_tile, 16 * half, 16 * s, lane);
        fa::mma_bf16_16x8x16(d_score[0], a[0], a[1], a[2], a[3], b[0], b[1]);
        fa::mma_bf16_16x8x16(d_score[1], a[0], a[1], a[2], a[3], b[2], b[3]);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float p[2], ds[2];
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int e = 2 * r + c, column = 16 * half + 8 * j + pair_col + c, query = query0 + column;
            const bool visible = query >= row_query_from[r] && query < row_query_to[r];
            p[c] = visible ? exp2f(prob[j][e] * score_scale - lse_tile[column] * fa::kLog2e) : 0.0f;
            ds[c] = p[c] * (d_score[j][e] - delta_tile[column]);
          }
          const int offset = (key_group * 16 + group_row + 8 * r) * kProbStride + 16 * half + 8 * j + pair_col;
          *reinterpret_cast<uint32_t*>(prob_tile + offset) = fa::pack_bf16(p[0], p[1]);
          *reinterpret_cast<uint32_t*>(dscore_tile + offset) = fa::pack_bf16(ds[0], ds[1]);
        }
      }
      __syncthreads();  // P^T and dS^T of all 32 queries visible

      // dV += P^T dO and dK += dS^T Q for 16 keys x this warp's half of D.
#pragma unroll
      for (int t = 0; t < kDkvQueryRows / 16; ++t) {
        uint32_t a[4];
        fa::load_a_fragment<kProbStride>(a, prob_tile, key_group * 16, 16 * t, lane);
#pragma unroll
        for (int nn = 0; nn < kAccTiles / 2; ++nn) {
          uint32_t b[4];
          fa::load_b_fragments_from_columns<kStride>(b, do_tile, 16 * t, half * kHalfDim + 16 * nn, lane);
          fa::mma_bf16_16x8x16(dv_acc[2 * nn], a[0], a[1], a[2], a[3], b[0], b[1]);
          fa::mma_bf16_16x8x16(dv_acc[2 * nn + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
        }
      }
#pragma unroll
      for (int t = 0; t < kDkvQueryRows / 16; ++t) {
        uint32_t a[4];
        fa::load_a_fragment<kProbStride>(a, dscore_tile, key_group * 16, 16 * t, lane);
#pragma unroll
        for (int nn = 0; nn < kAccTiles / 2; ++nn) {
          uint32_t b[4];
          fa::load_b_fragments_from_columns<kStride>(b, q_tile, 16 * t, half * kHalfDim + 16 * nn, lane);
          fa::mma_bf16_16x8x16(dk_acc[2 * nn], a[0], a[1], a[2], a[3], b[0], b[1]);
          fa::mma_bf16_16x8x16(dk_acc[2 * nn + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
        }
      }
      __syncthreads();  // this step's buffers, P^T and dS^T are free for reuse
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = first_key + key_group * 16 + group_row + 8 * r;
      if (key >= num_tokens) continue;
      const int first_col = half * kHalfDim;
      const int64_t offset =
          (static_cast<int64_t>(key) * num_kv_heads + kv_head) * head_dim + first_col + pair_col;
#pragma unroll
      for (int n = 0; n < kAccTiles; ++n) {
        if (first_col + 8 * n >= head_dim) break;  // padding columns
        *reinterpret_cast<__nv_bfloat162*>(dk + offset + 8 * n) =
            __floats2bfloat162_rn(dk_acc[n][2 * r] * shape.scale, dk_acc[n][2 * r + 1] * shape.scale);
        *reinterpret_cast<__nv_bfloat162*>(dv + offset + 8 * n) =
            __floats2bfloat162_rn(dv_acc[n][2 * r], dv_acc[n][2 * r + 1]);
      }
    }
  }
}

}  // namespace

void flash_attention_backward_fast_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q,
                                        const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* out,
                                        const float* lse, const __nv_bfloat16* d_out, __nv_bfloat16* dq,
                                        __nv_bfloat16* dk, __nv_bfloat16* dv, void* workspace, size_t workspace_bytes,
                                        cudaStream_t stream) {
  const char* where = "flash_attention_backward_fast_cuda";
  check_flash_attention_shape(shape, where);
  CHECK(flash_attention_fast_supported(shape), where, ": head dim ", shape.head_dim,
        " is not a multiple of 8 in (128, 256] (use flash_attention_backward_cuda, which falls back)");
  const size_t needed = flash_attention_backward_workspace_bytes(shape);
  CHECK(workspace_bytes >= needed, where, ": workspace of ", workspace_bytes, " bytes is smaller than the ", needed,
        " bytes needed (flash_attention_backward_workspace_bytes)");
  if (shape.num_tokens == 0) return;
  CHECK(q && k && v && out && lse && d_out && dq && dk && dv && workspace, where, ": null tensor or workspace pointer");
  for (const void* p : {static_cast<const void*>(q), static_cast<const void*>(k), static_cast<const void*>(v),
                        static_cast<const void*>(out), static_cast<const void*>(d_out)})
    CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, where, ": q, k, v, out and d_out must be 16-byte aligned");
  for (const void* p : {static_cast<const void*>(dq), static_cast<const void*>(dk), static_cast<const void*>(dv)})
    CHECK(reinterpret_cast<uintptr_t>(p) % 4 == 0, where, ": dq, dk and dv must be 4-byte aligned");
  CHECK(reinterpret_cast<uintptr_t>(lse) % 4 == 0 && reinterpret_cast<uintptr_t>(workspace) % 4 == 0, where,
        ": lse and workspace must be 4-byte aligned");

  float* delta = static_cast<float*>(workspace);
  const int64_t rows = shape.num_tokens * shape.num_q_heads;
  delta_fast_kernel<<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(out, d_out, rows,
                                                                               static_cast<int>(shape.head_dim), delta);
  CUDA_CHECK_LAUNCH();

  CUDA_CHECK(cudaFuncSetAttribute(dq_fast_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(kDqSharedBytes)));
  const dim3 dq_grid(static_cast<unsigned>((shape.num_tokens + kDqQueryRows - 1) / kDqQueryRows),
                     static_cast<unsigned>(shape.num_q_heads));
  dq_fast_kernel<<<dq_grid, 32 * kDqWarps, kDqSharedBytes, stream>>>(shape, q, k, v, lse, d_out, delta, dq);
  CUDA_CHECK_LAUNCH();

  CUDA_CHECK(cudaFuncSetAttribute(dkv_fast_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(kDkvSharedBytes)));
  const int64_t key_tiles = (shape.num_tokens + kDkvKeyRows - 1) / kDkvKeyRows;
  const dim3 dkv_grid(static_cast<unsigned>((key_tiles + 1) / 2), static_cast<unsigned>(shape.num_kv_heads));
  dkv_fast_kernel<<<dkv_grid, 32 * kDkvWarps, kDkvSharedBytes, stream>>>(shape, q, k, v, lse, d_out, delta, dk, dv);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
