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

constexpr int kHeadDim = 256;  // padded width of the tiles
constexpr int kStride = kHeadDim + fa::kPad;

// delta[row] = dO[row, :] . O[row, :] over rows = (token, query head), one warp per row with
// 16-byte loads (head_dim a multiple of 8, rows 16-byte aligned).
__global__ void __launch_bounds__(256)
    delta_wide_kernel(const __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ d_out, int64_t rows,
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
    dq_wide_kernel(FlashAttentionShape shape, const __nv_bfloat16* __restrict__ q,
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
  const int head = blockIdx.y, kv_head = head / (num_q_heads / num_kv_heads);
  const int first_query = (gridDim.x - 1 - blockIdx.x) * kDqQueryRows;  // long causal rows first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group_row = lane / 4, pair_col = 2 * (lane % 4);

  const fa::QueryRows rows = fa::query_rows(shape, first_query, kDqQueryRows, warp * 16, group_row);
  const int block_key_begin = rows.block_key_begin, block_key_end = rows.block_key_end;
  float row_lse[2], row_delta[2];  // lse in log2 units
  fa::load_row_stats(row_lse, row_delta, rows, num_tokens, num_q_heads, head, lse, delta);

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
  fa::zero_fragments(dq_acc);

  for (int key0 = block_key_begin; key0 < block_key_end; key0 += kDqKeyRows) {
    const bool has_next = key0 + kDqKeyRows < block_key_end;
    fa::cp_async_wait<1>();  // V(j) (and Q, dO) landed; K(j) may still be in flight
    __syncthreads();

    float d_prob[kKeyTiles][4], score[kKeyTiles][4];
    fa::zero_fragments(d_prob);
    fa::zero_fragments(score);
    // dP = dO V^T
    fa::ldmatrix_rows_times_rows_t<kStride, kHeadDim / 16>(d_prob, do_tile, warp * 16, v_tile, lane);

    fa::cp_async_wait<0>();  // K(j) landed
    __syncthreads();         // ... for all threads; every warp is done with V(j)
    if (has_next) {
      fa::issue_tile_copy<kHeadDim, kStride>(v_tile, v, key0 + kDqKeyRows, kDqKeyRows, block_key_end, num_kv_heads,
                                             kv_head, head_dim);
      fa::cp_async_commit();
    }

    // S = Q K^T
    fa::ldmatrix_rows_times_rows_t<kStride, kHeadDim / 16>(score, q_tile, warp * 16, k_tile, lane);
    fa::dscore_step(score, d_prob, rows, row_lse, row_delta, key0, pair_col, score_scale);
    // dQ += dS K: the dS accumulators of key tiles 2t, 2t+1 are the A fragment of k-step t.
    fa::ldmatrix_weights_times_tile<kStride>(dq_acc, score, k_tile, lane);

    if (has_next) {
      __syncthreads();  // every warp is done with K(j)
      fa::issue_tile_copy<kHeadDim, kStride>(k_tile, k, key0 + kDqKeyRows, kDqKeyRows, block_key_end, num_kv_heads,
                                             kv_head, head_dim);
      fa::cp_async_commit();
    }
  }

  fa::store_dq_rows(dq_acc, rows, num_tokens, num_q_heads, head, head_dim, pair_col, shape.scale, dq);
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
    dkv_wide_kernel(FlashAttentionShape shape, const __nv_bfloat16* __restrict__ q,
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
    const fa::KeyRows rows = fa::key_rows(shape, first_key, kDkvKeyRows, key_group * 16, group_row);
    const int block_query_begin = rows.block_query_begin, block_query_end = rows.block_query_end;
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
    fa::zero_fragments(dk_acc);
    fa::zero_fragments(dv_acc);

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
      fa::zero_fragments(prob);
      fa::zero_fragments(d_score);
#pragma unroll 4  // fully unrolled, the loads hoisted for latency push the 128 accumulators to spill
      for (int s = 0; s < kHeadDim / 16; ++s) {
        uint32_t a[4], b[4];
        fa::load_a_fragment<kStride>(a, k_tile, key_group * 16, 16 * s, lane);
        fa::load_b_fragments_from_rows<kStride>(b, q_tile, 16 * half, 16 * s, lane);
        fa::mma_n_tile_pair(prob[0], prob[1], a, b);
        fa::load_a_fragment<kStride>(a, v_tile, key_group * 16, 16 * s, lane);
        fa::load_b_fragments_from_rows<kStride>(b, do_tile, 16 * half, 16 * s, lane);
        fa::mma_n_tile_pair(d_score[0], d_score[1], a, b);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float p[2], ds[2];
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int e = 2 * r + c, column = 16 * half + 8 * j + pair_col + c, query = query0 + column;
            const bool visible = query >= rows.query_from[r] && query < rows.query_to[r];
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
      fa::ldmatrix_shared_times_tile<kProbStride, kStride, kDkvQueryRows / 16>(dv_acc, prob_tile, key_group * 16,
                                                                               do_tile, half * kHalfDim, lane);
      fa::ldmatrix_shared_times_tile<kProbStride, kStride, kDkvQueryRows / 16>(dk_acc, dscore_tile, key_group * 16,
                                                                               q_tile, half * kHalfDim, lane);
      __syncthreads();  // this step's buffers, P^T and dS^T are free for reuse
    }

    fa::store_dk_dv_rows(dk_acc, dv_acc, rows.key, num_tokens, num_kv_heads, kv_head, head_dim, half * kHalfDim,
                         pair_col, shape.scale, dk, dv);
  }
}

}  // namespace

void flash_attention_backward_wide_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q,
                                        const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* out,
                                        const float* lse, const __nv_bfloat16* d_out, __nv_bfloat16* dq,
                                        __nv_bfloat16* dk, __nv_bfloat16* dv, void* workspace, size_t workspace_bytes,
                                        cudaStream_t stream) {
  const char* where = "flash_attention_backward_wide_cuda";
  check_flash_attention_shape(shape, where);
  CHECK(flash_attention_wide_supported(shape), where, ": head dim ", shape.head_dim,
        " is not a multiple of 8 in (128, 256] (use flash_attention_backward_cuda, which falls back)");
  fa::check_backward_workspace(shape, workspace_bytes, where);
  if (shape.num_tokens == 0) return;
  fa::check_backward_mma_pointers(q, k, v, out, lse, d_out, dq, dk, dv, workspace, where);
  // The warp-per-row delta kernel reads out in 16-byte vectors; the dK/dV pass copies lse and delta by
  // 4-byte cp.async.
  CHECK(fa::is_aligned(out, 16), where, ": out must be 16-byte aligned");
  CHECK(fa::is_aligned(lse, 4) && fa::is_aligned(workspace, 4), where, ": lse and workspace must be 4-byte aligned");

  float* delta = static_cast<float*>(workspace);
  const int64_t rows = shape.num_tokens * shape.num_q_heads;
  delta_wide_kernel<<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(out, d_out, rows,
                                                                               static_cast<int>(shape.head_dim), delta);
  CUDA_CHECK_LAUNCH();

  static_assert(kDqSharedBytes <= kSm80MaxSharedBytesPerBlock, "fits an sm_80 block (the sm_80 path)");
  allow_dynamic_shared_memory(dq_wide_kernel, kDqSharedBytes, "flash attention backward (wide)");
  const dim3 dq_grid(static_cast<unsigned>((shape.num_tokens + kDqQueryRows - 1) / kDqQueryRows),
                     static_cast<unsigned>(shape.num_q_heads));
  dq_wide_kernel<<<dq_grid, 32 * kDqWarps, kDqSharedBytes, stream>>>(shape, q, k, v, lse, d_out, delta, dq);
  CUDA_CHECK_LAUNCH();

  static_assert(kDkvSharedBytes <= kSm80MaxSharedBytesPerBlock, "fits an sm_80 block (the sm_80 path)");
  allow_dynamic_shared_memory(dkv_wide_kernel, kDkvSharedBytes, "flash attention backward (wide)");
  const int64_t key_tiles = (shape.num_tokens + kDkvKeyRows - 1) / kDkvKeyRows;
  const dim3 dkv_grid(static_cast<unsigned>((key_tiles + 1) / 2), static_cast<unsigned>(shape.num_kv_heads));
  dkv_wide_kernel<<<dkv_grid, 32 * kDkvWarps, kDkvSharedBytes, stream>>>(shape, q, k, v, lse, d_out, delta, dk, dv);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
