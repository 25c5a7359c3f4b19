// Tensor-core forward of packed-segment attention (FlashAttention-2 layout) for head dims that are
// multiples of 8 up to 256 (tiles padded to 64, 80, 128 or 256 columns): a block of 4 warps owns 64 queries of one head (16 per warp); 64-key K/V tiles pass
// through shared memory; S = Q K^T and O += P V run on mma.sync m16n8k16 (bf16 in, fp32 out); the
// online softmax stays in fp32 registers, P is handed from the S accumulators to the A operand
// without touching shared memory. Works on sm_80 and sm_90a.
#include <cstdint>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/flash_attention/flash_attention_common.cuh"
#include "kernels/flash_attention/flash_attention_cuda.h"
#include "kernels/flash_attention/flash_attention_mma.cuh"

namespace deltamoe {
namespace {

namespace fa = flash_attention_detail;

constexpr int kWarps = fa::kMmaWarps;
constexpr int kQueryRows = fa::kTileRows;  // queries per block
constexpr int kKeyRows = fa::kTileRows;    // keys per tile
constexpr int kPad = fa::kPad;
constexpr float kLog2e = fa::kLog2e;
using fa::load_pair;
using fa::load_tile;
using fa::mma_bf16_16x8x16;
using fa::pack_bf16;

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
  constexpr int kDimSteps = kHeadDim / 16;  // k-steps of Q K^T
  constexpr int kKeyTiles = kKeyRows / 8;   // n-tiles of S
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
  const int group_row = lane / 4, pair_col = 2 * (lane % 4);  // fragment coordinates

  // This thread's two rows: warp * 16 + group_row and + 8.
  int row_query[2], row_key_begin[2], row_key_limit[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int query = first_query + warp * 16 + group_row + 8 * r;
    row_query[r] = query;
    const fa::Segment segment = fa::find_segment(shape.cu_seqlens, num_segments, min(query, last_query));
    const bool valid = query < num_tokens;
    row_key_begin[r] = segment.begin;
    row_key_limit[r] = !valid ? segment.begin : shape.causal ? query + 1 : segment.end;  // empty when invalid
  }
  const int block_key_begin = fa::find_segment(shape.cu_seqlens, num_segments, first_query).begin;
  const int block_key_end =
      shape.causal ? last_query + 1 : fa::find_segment(shape.cu_seqlens, num_segments, last_query).end;

  load_tile<kHeadDim>(q_tile, q, first_query, kQueryRows, num_tokens, num_q_heads, head, head_dim);

  float acc[kDimTiles][4];
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};  // in log2 units (scores times scale * log2 e)
  float row_sum[2] = {0.0f, 0.0f};            // this lane's share; the 4 lanes of a row add up at the end
  const float score_scale = shape.scale * kLog2e;
  const uint16_t* q_rows = q_tile + (warp * 16 + group_row) * kStride + pair_col;

  for (int key0 = block_key_begin; key0 < block_key_end; key0 += kKeyRows) {
    __syncthreads();  // previous K/V tile no longer read (and the Q tile is complete on the first pass)
    load_tile<kHeadDim>(k_tile, k, key0, kKeyRows, block_key_end, num_kv_heads, kv_head, head_dim);
    load_tile<kHeadDim>(v_tile, v, key0, kKeyRows, block_key_end, num_kv_heads, kv_head, head_dim);
    __syncthreads();

    float score[kKeyTiles][4];
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) score[j][0] = score[j][1] = score[j][2] = score[j][3] = 0.0f;
#pragma unroll
    for (int s = 0; s < kDimSteps; ++s) {
      const uint16_t* qa = q_rows + 16 * s;
      const uint32_t a0 = load_pair(qa), a1 = load_pair(qa + 8 * kStride);
      const uint32_t a2 = load_pair(qa + 8), a3 = load_pair(qa + 8 * kStride + 8);
#pragma unroll
      for (int j = 0; j < kKeyTiles; ++j) {
        // B[d][key] = K[key][d]: column group_row of the n-tile is key 8j + group_row.
        const uint16_t* kb = k_tile + (8 * j + group_row) * kStride + 16 * s + pair_col;
        mma_bf16_16x8x16(score[j], a0, a1, a2, a3, load_pair(kb), load_pair(kb + 8));
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

    // O += P V: the S accumulators of key tiles 2t and 2t+1 are the A fragment of k-step t.
#pragma unroll
    for (int t = 0; t < kKeyRows / 16; ++t) {
      const uint32_t a0 = pack_bf16(score[2 * t][0], score[2 * t][1]);
      const uint32_t a1 = pack_bf16(score[2 * t][2], score[2 * t][3]);
      const uint32_t a2 = pack_bf16(score[2 * t + 1][0], score[2 * t + 1][1]);
      const uint32_t a3 = pack_bf16(score[2 * t + 1][2], score[2 * t + 1][3]);
      // B[key][d] = V[key][d]: rows 16t + pair_col (+1) and + 8, column 8n + group_row.
      const uint16_t* vb = v_tile + (16 * t + pair_col) * kStride + group_row;
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        const uint16_t* column = vb + 8 * n;
        const uint32_t b0 = static_cast<uint32_t>(column[0]) | (static_cast<uint32_t>(column[kStride]) << 16);
        const uint32_t b1 =
            static_cast<uint32_t>(column[8 * kStride]) | (static_cast<uint32_t>(column[9 * kStride]) << 16);
        mma_bf16_16x8x16(acc[n], a0, a1, a2, a3, b0, b1);
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
      lse[static_cast<int64_t>(query) * num_q_heads + head] = row_max[r] / kLog2e + logf(row_sum[r]);
  }
}

template <int kHeadDim>
void launch_forward_mma(const FlashAttentionShape& shape, const __nv_bfloat16* q, const __nv_bfloat16* k,
                        const __nv_bfloat16* v, __nv_bfloat16* out, float* lse, cudaStream_t stream) {
  constexpr size_t kShared = shared_bytes_for<kHeadDim>();
  CUDA_CHECK(cudaFuncSetAttribute(forward_mma_kernel<kHeadDim>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(kShared)));
  const dim3 grid(static_cast<unsigned>((shape.num_tokens + kQueryRows - 1) / kQueryRows),
                  static_cast<unsigned>(shape.num_q_heads));
  forward_mma_kernel<kHeadDim><<<grid, 32 * kWarps, kShared, stream>>>(shape, q, k, v, out, lse);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool flash_attention_forward_mma_supported(const FlashAttentionShape& shape) {
  return shape.head_dim % 8 == 0 && shape.head_dim >= 8 && shape.head_dim <= kFlashAttentionMaxHeadDim;
}

void flash_attention_forward_mma_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q,
                                      const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out, float* lse,
                                      cudaStream_t stream) {
  check_flash_attention_shape(shape, "flash_attention_forward_mma_cuda");
  CHECK(flash_attention_forward_mma_supported(shape), "flash_attention_forward_mma_cuda: head dim ", shape.head_dim,
        " is not a multiple of 8 (use flash_attention_forward_cuda, which falls back)");
  if (shape.num_tokens == 0) return;
  CHECK(q && k && v && out && lse, "flash_attention_forward_mma_cuda: null tensor pointer");
  // 16-byte loads of head rows need 16-byte aligned tensors.
  for (const void* p : {static_cast<const void*>(q), static_cast<const void*>(k), static_cast<const void*>(v)})
    CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "flash_attention_forward_mma_cuda: q/k/v must be 16-byte aligned");
  CHECK(reinterpret_cast<uintptr_t>(out) % 4 == 0, "flash_attention_forward_mma_cuda: out must be 4-byte aligned");
  // Tiles are padded with zero columns to the next instantiated width (72 -> 80 for the vision tower).
  if (shape.head_dim <= 64) {
    launch_forward_mma<64>(shape, q, k, v, out, lse, stream);
  } else if (shape.head_dim <= 80) {
    launch_forward_mma<80>(shape, q, k, v, out, lse, stream);
  } else if (shape.head_dim <= 128) {
    launch_forward_mma<128>(shape, q, k, v, out, lse, stream);
  } else {
    launch_forward_mma<256>(shape, q, k, v, out, lse, stream);
  }
}

}  // namespace deltamoe
