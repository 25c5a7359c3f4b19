// Forward of packed-segment attention: one block per (32-query tile, query head); K/V tiles of 32
// keys pass through shared memory; each query row keeps its output and online-softmax state in
// fp32 registers, eight lanes per row splitting the head dim. Also the shared shape check and the
// dispatch between this kernel and the tensor-core one (flash_attention_forward_mma.cu).
#include <cmath>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/flash_attention/flash_attention_common.cuh"
#include "kernels/flash_attention/flash_attention_cuda.h"

namespace deltamoe {

void check_flash_attention_shape(const FlashAttentionShape& shape, const char* where) {
  CHECK(shape.num_tokens >= 0 && shape.num_tokens < (int64_t{1} << 31), where, ": token count ", shape.num_tokens,
        " is outside [0, 2^31)");
  CHECK(shape.num_q_heads > 0 && shape.num_kv_heads > 0 && shape.num_q_heads % shape.num_kv_heads == 0, where, ": ",
        shape.num_q_heads, " query heads are not a positive multiple of ", shape.num_kv_heads, " key/value heads");
  CHECK(shape.num_q_heads <= 65535, where, ": at most 65535 query heads, got ", shape.num_q_heads);
  CHECK(shape.head_dim >= 1 && shape.head_dim <= kFlashAttentionMaxHeadDim, where, ": head dim ", shape.head_dim,
        " is outside 1..", kFlashAttentionMaxHeadDim);
  CHECK(shape.num_segments >= 1 && shape.num_segments < (int64_t{1} << 31), where,
        ": cu_seqlens needs at least two entries (num_segments >= 1), got ", shape.num_segments, " segments");
  CHECK(shape.cu_seqlens != nullptr, where, ": cu_seqlens is null");
  CHECK(std::isfinite(shape.scale), where, ": scale must be finite, got ", shape.scale);
}

namespace {

namespace fa = flash_attention_detail;

constexpr int kKeyTile = 32;

// kSlices = head-dim values per lane (D <= 8 * kSlices); lanes past D hold zeros.
template <int kSlices>
__global__ void __launch_bounds__(fa::kThreadsPerBlock)
    forward_kernel(FlashAttentionShape shape, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                   const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ out, float* __restrict__ lse) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const int num_tokens = static_cast<int>(shape.num_tokens), num_q_heads = static_cast<int>(shape.num_q_heads);
  const int num_kv_heads = static_cast<int>(shape.num_kv_heads), head_dim = static_cast<int>(shape.head_dim);
  const int num_segments = static_cast<int>(shape.num_segments);
  __nv_bfloat16* k_tile = reinterpret_cast<__nv_bfloat16*>(shared_bytes);
  __nv_bfloat16* v_tile = k_tile + kKeyTile * head_dim;

  const int head = blockIdx.y, kv_head = head / (num_q_heads / num_kv_heads);
  const int row = threadIdx.x / fa::kThreadsPerRow, lane = threadIdx.x % fa::kThreadsPerRow;
  const int first_query = blockIdx.x * fa::kRowsPerBlock;
  const int last_query = min(first_query + fa::kRowsPerBlock, num_tokens) - 1;
  const int query = first_query + row;
  const bool row_valid = query < num_tokens;

  // This row sees keys [segment.begin, key_limit); the block walks the union of its rows' ranges
  // (rows of several short segments share the tiles and mask the other segments out).
  const fa::Segment segment = fa::find_segment(shape.cu_seqlens, num_segments, row_valid ? query : last_query);
  const int key_limit = shape.causal ? query + 1 : segment.end;
  const int block_key_begin = fa::find_segment(shape.cu_seqlens, num_segments, first_query).begin;
  const int block_key_end =
      shape.causal ? last_query + 1 : fa::find_segment(shape.cu_seqlens, num_segments, last_query).end;

  float q_slice[kSlices], acc[kSlices];
  const int64_t q_offset = (static_cast<int64_t>(query) * num_q_heads + head) * head_dim;
#pragma unroll
  for (int c = 0; c < kSlices; ++c) {
    const int d = lane + fa::kThreadsPerRow * c;
    q_slice[c] = row_valid && d < head_dim ? __bfloat162float(q[q_offset + d]) : 0.0f;
    acc[c] = 0.0f;
  }
  float running_max = -INFINITY, running_sum = 0.0f;

  for (int key0 = block_key_begin; key0 < block_key_end; key0 += kKeyTile) {
    __syncthreads();  // the previous tile is no longer read
    fa::load_rows(k_tile, k, key0, kKeyTile, block_key_end, num_kv_heads, kv_head, head_dim);
    fa::load_rows(v_tile, v, key0, kKeyTile, block_key_end, num_kv_heads, kv_head, head_dim);
    __syncthreads();

    float score[kKeyTile];
    float tile_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < kKeyTile; ++j) {
      float partial = 0.0f;
#pragma unroll
      for (int c = 0; c < kSlices; ++c) {
        const int d = lane + fa::kThreadsPerRow * c;
        if (d < head_dim) partial += q_slice[c] * __bfloat162float(k_tile[j * head_dim + d]);
      }
      const float dot = fa::row_sum(partial);
      const int key = key0 + j;
      const bool visible = row_valid && key >= segment.begin && key < key_limit;
      score[j] = visible ? dot * shape.scale : -INFINITY;
      tile_max = fmaxf(tile_max, score[j]);
    }
    if (tile_max == -INFINITY) continue;  // nothing visible to this row in this tile (no shuffles below)
    const float new_max = fmaxf(running_max, tile_max);
    const float correction = expf(running_max - new_max);  // 0 on the first visible tile
    running_sum *= correction;
#pragma unroll
    for (int c = 0; c < kSlices; ++c) acc[c] *= correction;
#pragma unroll
    for (int j = 0; j < kKeyTile; ++j) {
      const float p = expf(score[j] - new_max);  // masked keys: exp(-inf) = 0
      running_sum += p;
#pragma unroll
      for (int c = 0; c < kSlices; ++c) {
        const int d = lane + fa::kThreadsPerRow * c;
        if (d < head_dim) acc[c] += p * __bfloat162float(v_tile[j * head_dim + d]);
      }
    }
    running_max = new_max;
  }

  if (!row_valid) return;
  // Every row sees at least its own key (causal) or its non-empty segment, so running_sum > 0.
  const float inverse_sum = 1.0f / running_sum;
#pragma unroll
  for (int c = 0; c < kSlices; ++c) {
    const int d = lane + fa::kThreadsPerRow * c;
    if (d < head_dim) out[q_offset + d] = __float2bfloat16(acc[c] * inverse_sum);
  }
  if (lane == 0) lse[static_cast<int64_t>(query) * num_q_heads + head] = running_max + logf(running_sum);
}

template <int kSlices>
void launch_forward(const FlashAttentionShape& shape, const __nv_bfloat16* q, const __nv_bfloat16* k,
                    const __nv_bfloat16* v, __nv_bfloat16* out, float* lse, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((shape.num_tokens + fa::kRowsPerBlock - 1) / fa::kRowsPerBlock),
                  static_cast<unsigned>(shape.num_q_heads));
  const size_t shared_bytes = 2 * kKeyTile * static_cast<size_t>(shape.head_dim) * sizeof(__nv_bfloat16);
  forward_kernel<kSlices><<<grid, fa::kThreadsPerBlock, shared_bytes, stream>>>(shape, q, k, v, out, lse);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void flash_attention_forward_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                  const __nv_bfloat16* v, __nv_bfloat16* out, float* lse, cudaStream_t stream) {
  const auto aligned = [](const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
  const bool mma_aligned = aligned(q, 16) && aligned(k, 16) && aligned(v, 16) && aligned(out, 4);
  if (flash_attention_wide_supported(shape) && mma_aligned) {
    flash_attention_forward_wide_cuda(shape, q, k, v, out, lse, stream);
  } else if (flash_attention_forward_mma_supported(shape) && mma_aligned) {
    flash_attention_forward_mma_cuda(shape, q, k, v, out, lse, stream);
  } else {
    flash_attention_forward_simt_cuda(shape, q, k, v, out, lse, stream);
  }
}

void flash_attention_forward_simt_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q,
                                       const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
                                       float* lse, cudaStream_t stream) {
  check_flash_attention_shape(shape, "flash_attention_forward_simt_cuda");
  if (shape.num_tokens == 0) return;
  CHECK(q && k && v && out && lse, "flash_attention_forward_simt_cuda: null tensor pointer");
  if (shape.head_dim <= 64) {
    launch_forward<8>(shape, q, k, v, out, lse, stream);
  } else if (shape.head_dim <= 128) {
    launch_forward<16>(shape, q, k, v, out, lse, stream);
  } else {
    launch_forward<32>(shape, q, k, v, out, lse, stream);
  }
}

}  // namespace deltamoe
