// Pipelined tensor-core forward of packed-segment attention (FlashAttention-2 schedule) for head
// dims in (128, 256] that are multiples of 8: a block of 4 warps owns 64 queries of one head (16
// per warp); the Q tile stays in shared memory, 64-key K and V tiles arrive by cp.async so that V
// loads while S = Q K^T runs and the next K loads while O += P V runs; operands come through
// ldmatrix (.trans for V); online softmax in fp32 registers; causal tiles past the diagonal skipped.
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

constexpr int kWarps = 4;
constexpr int kQueryRows = 16 * kWarps;  // queries per block
constexpr int kKeyRows = 64;             // keys per K/V tile
constexpr int kHeadDim = 256;            // padded width of the tiles
constexpr int kStride = kHeadDim + fa::kPad;
// Q, K and V tiles, one each: 99 KB, so two blocks share an H100 SM (one on an A100).
constexpr size_t kSharedBytes = static_cast<size_t>(kQueryRows + 2 * kKeyRows) * kStride * sizeof(uint16_t);

__global__ void __launch_bounds__(32 * kWarps, 2)
    forward_fast_kernel(FlashAttentionShape shape, const __nv_bfloat16* __restrict__ q,
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
  const int num_segments = static_cast<int>(shape.num_segments);
  const int head = blockIdx.y, kv_head = head / (num_q_heads / num_kv_heads);
  // Later query tiles see more keys under the causal mask: start them first.
  const int first_query = (gridDim.x - 1 - blockIdx.x) * kQueryRows;
  const int last_query = min(first_query + kQueryRows, num_tokens) - 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group_row = lane / 4, pair_col = 2 * (lane % 4);  // C fragment coordinates

  int row_query[2], row_key_begin[2], row_key_limit[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int query = first_query + warp * 16 + group_row + 8 * r;
    row_query[r] = query;
    const fa::Segment segment = fa::find_segment(shape.cu_seqlens, num_segments, min(query, last_query));
    row_key_begin[r] = segment.begin;
    row_key_limit[r] = query >= num_tokens ? segment.begin : shape.causal ? query + 1 : segment.end;
  }
  const int block_key_begin = fa::find_segment(shape.cu_seqlens, num_segments, first_query).begin;
  const int block_key_end =
      shape.causal ? last_query + 1 : fa::find_segment(shape.cu_seqlens, num_segments, last_query).end;

  // Group 0: Q and the first K tile.
  fa::issue_tile_copy<kHeadDim, kStride>(q_tile, q, first_query, kQueryRows, num_tokens, num_q_heads, head, head_dim);
  fa::issue_tile_copy<kHeadDim, kStride>(k_tile, k, block_key_begin, kKeyRows, block_key_end, num_kv_heads, kv_head,
                                         head_dim);
  fa::cp_async_commit();

  float acc[kDimTiles][4];
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
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
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) score[j][0] = score[j][1] = score[j][2] = score[j][3] = 0.0f;
#pragma unroll
    for (int s = 0; s < kHeadDim / 16; ++s) {
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

    // Mask, scale, and the online-softmax update of both rows.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2, key = key0 + 8 * j + pair_col + (e % 2);
        const bool visible = key >= row_key_begin[r] && key < row_key_limit[r];
        score[j][e] = visible ? score[j][e] * score_scale : -INFINITY;
        tile_max[r] = fmaxf(tile_max[r], score[j][e]);
      }
    }
    float correction[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float new_max = fmaxf(row_max[r], tile_max[r]);
      // Rows with nothing visible yet keep max -inf; guard the -inf - -inf cases.
      correction[r] = row_max[r] == -INFINITY ? 0.0f : exp2f(row_max[r] - new_max);
      row_max[r] = new_max;
      row_sum[r] *= correction[r];
    }
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      acc[n][0] *= correction[0];
      acc[n][1] *= correction[0];
      acc[n][2] *= correction[1];
      acc[n][3] *= correction[1];
    }
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const float p = score[j][e] == -INFINITY ? 0.0f : exp2f(score[j][e] - row_max[r]);
        score[j][e] = p;
        row_sum[r] += p;
      }
    }

    fa::cp_async_wait<0>();  // V(key0) has landed
    __syncthreads();         // ... for every thread; and every warp is done with K(key0)
    if (key0 + kKeyRows < block_key_end) {
      fa::issue_tile_copy<kHeadDim, kStride>(k_tile, k, key0 + kKeyRows, kKeyRows, block_key_end, num_kv_heads,
                                             kv_head, head_dim);
      fa::cp_async_commit();
    }

    // O += P V: the S accumulators of key tiles 2t and 2t+1 are the A fragment of k-step t.
#pragma unroll
    for (int t = 0; t < kKeyRows / 16; ++t) {
      const uint32_t a0 = fa::pack_bf16(score[2 * t][0], score[2 * t][1]);
      const uint32_t a1 = fa::pack_bf16(score[2 * t][2], score[2 * t][3]);
      const uint32_t a2 = fa::pack_bf16(score[2 * t + 1][0], score[2 * t + 1][1]);
      const uint32_t a3 = fa::pack_bf16(score[2 * t + 1][2], score[2 * t + 1][3]);
#pragma unroll
      for (int nn = 0; nn < kDimTiles / 2; ++nn) {
        uint32_t b[4];
        fa::load_b_fragments_from_columns<kStride>(b, v_tile, 16 * t, 16 * nn, lane);
        fa::mma_bf16_16x8x16(acc[2 * nn], a0, a1, a2, a3, b[0], b[1]);
        fa::mma_bf16_16x8x16(acc[2 * nn + 1], a0, a1, a2, a3, b[2], b[3]);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int query = row_query[r];
    if (query >= num_tokens) continue;
    // A valid row always sees its own key (causal) or its non-empty segment: row_sum > 0.
    const float inverse_sum = 1.0f / row_sum[r];
    __nv_bfloat16* out_row = out + (static_cast<int64_t>(query) * num_q_heads + head) * head_dim + pair_col;
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      if (8 * n >= head_dim) break;  // padding columns (head_dim is a multiple of 8)
      *reinterpret_cast<__nv_bfloat162*>(out_row + 8 * n) =
          __floats2bfloat162_rn(acc[n][2 * r] * inverse_sum, acc[n][2 * r + 1] * inverse_sum);
    }
    if (lane % 4 == 0)
      lse[static_cast<int64_t>(query) * num_q_heads + head] = row_max[r] / fa::kLog2e + logf(row_sum[r]);
  }
}

}  // namespace

bool flash_attention_fast_supported(const FlashAttentionShape& shape) {
  return shape.head_dim % 8 == 0 && shape.head_dim > 128 && shape.head_dim <= 256;
}

void flash_attention_forward_fast_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q,
                                       const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
                                       float* lse, cudaStream_t stream) {
  const char* where = "flash_attention_forward_fast_cuda";
  check_flash_attention_shape(shape, where);
  CHECK(flash_attention_fast_supported(shape), where, ": head dim ", shape.head_dim,
        " is not a multiple of 8 in (128, 256] (use flash_attention_forward_cuda, which falls back)");
  if (shape.num_tokens == 0) return;
  CHECK(q && k && v && out && lse, where, ": null tensor pointer");
  for (const void* p : {static_cast<const void*>(q), static_cast<const void*>(k), static_cast<const void*>(v)})
    CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, where, ": q/k/v must be 16-byte aligned");
  CHECK(reinterpret_cast<uintptr_t>(out) % 4 == 0, where, ": out must be 4-byte aligned");
  CUDA_CHECK(cudaFuncSetAttribute(forward_fast_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(kSharedBytes)));
  const dim3 grid(static_cast<unsigned>((shape.num_tokens + kQueryRows - 1) / kQueryRows),
                  static_cast<unsigned>(shape.num_q_heads));
  forward_fast_kernel<<<grid, 32 * kWarps, kSharedBytes, stream>>>(shape, q, k, v, out, lse);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
