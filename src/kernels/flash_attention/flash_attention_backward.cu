// SIMT backward of packed-segment attention (any head dim; the dispatcher that prefers the
// tensor-core version lives here too), in two deterministic passes (no atomics):
//   1. per (32-query tile, query head): delta = dO . O, then dQ over the visible key tiles;
//   2. per (32-key tile, KV head): dK and dV over the visible query tiles of every query head in
//      the group, so the GQA sum stays inside one block.
// Probabilities are recomputed from the saved log-sum-exp: P = exp(scale * q.k - lse).
#include <cstdint>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/flash_attention/flash_attention_common.cuh"
#include "kernels/flash_attention/flash_attention_cuda.h"
#include "kernels/flash_attention/flash_attention_launch_checks.h"

namespace deltamoe {
namespace {

namespace fa = flash_attention_detail;

constexpr int kKeyTile = 16;    // keys per shared-memory tile in the dQ pass
constexpr int kQueryTile = 16;  // queries per shared-memory tile in the dK/dV pass

template <int kSlices>
__global__ void __launch_bounds__(fa::kThreadsPerBlock)
    dq_kernel(FlashAttentionShape shape, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
              const __nv_bfloat16* __restrict__ v, const __nv_bfloat16* __restrict__ out,
              const float* __restrict__ lse, const __nv_bfloat16* __restrict__ d_out, __nv_bfloat16* __restrict__ dq,
              float* __restrict__ delta) {
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

  const fa::Segment segment = fa::find_segment(shape.cu_seqlens, num_segments, row_valid ? query : last_query);
  const int key_limit = shape.causal ? query + 1 : segment.end;
  const int block_key_begin = fa::find_segment(shape.cu_seqlens, num_segments, first_query).begin;
  const int block_key_end =
      shape.causal ? last_query + 1 : fa::find_segment(shape.cu_seqlens, num_segments, last_query).end;

  float q_slice[kSlices], do_slice[kSlices], dq_acc[kSlices];
  const int64_t row_offset = (static_cast<int64_t>(query) * num_q_heads + head) * head_dim;
  float partial_delta = 0.0f;
#pragma unroll
  for (int c = 0; c < kSlices; ++c) {
    const int d = lane + fa::kThreadsPerRow * c;
    const bool in_row = row_valid && d < head_dim;
    q_slice[c] = in_row ? __bfloat162float(q[row_offset + d]) : 0.0f;
    do_slice[c] = in_row ? __bfloat162float(d_out[row_offset + d]) : 0.0f;
    partial_delta += in_row ? do_slice[c] * __bfloat162float(out[row_offset + d]) : 0.0f;
    dq_acc[c] = 0.0f;
  }
  const float row_delta = fa::row_sum(partial_delta);
  const int64_t stat_index = static_cast<int64_t>(query) * num_q_heads + head;
  if (row_valid && lane == 0) delta[stat_index] = row_delta;
  const float row_lse = row_valid ? lse[stat_index] : 0.0f;

  for (int key0 = block_key_begin; key0 < block_key_end; key0 += kKeyTile) {
    __syncthreads();
    fa::load_rows(k_tile, k, key0, kKeyTile, block_key_end, num_kv_heads, kv_head, head_dim);
    fa::load_rows(v_tile, v, key0, kKeyTile, block_key_end, num_kv_heads, kv_head, head_dim);
    __syncthreads();

    float d_score[kKeyTile];  // dS_ij = P_ij (dO_i . v_j - delta_i), before the scale
#pragma unroll
    for (int j = 0; j < kKeyTile; ++j) {
      float qk = 0.0f, dov = 0.0f;
#pragma unroll
      for (int c = 0; c < kSlices; ++c) {
        const int d = lane + fa::kThreadsPerRow * c;
        if (d < head_dim) {
          qk += q_slice[c] * __bfloat162float(k_tile[j * head_dim + d]);
          dov += do_slice[c] * __bfloat162float(v_tile[j * head_dim + d]);
        }
      }
      qk = fa::row_sum(qk);
      dov = fa::row_sum(dov);
      const int key = key0 + j;
      const bool visible = row_valid && key >= segment.begin && key < key_limit;
      const float p = visible ? expf(qk * shape.scale - row_lse) : 0.0f;
      d_score[j] = p * (dov - row_delta);
    }
#pragma unroll
    for (int c = 0; c < kSlices; ++c) {
      const int d = lane + fa::kThreadsPerRow * c;
      if (d >= head_dim) continue;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kKeyTile; ++j) sum += d_score[j] * __bfloat162float(k_tile[j * head_dim + d]);
      dq_acc[c] += sum;
    }
  }

  if (!row_valid) return;
#pragma unroll
  for (int c = 0; c < kSlices; ++c) {
    const int d = lane + fa::kThreadsPerRow * c;
    if (d < head_dim) dq[row_offset + d] = __float2bfloat16(dq_acc[c] * shape.scale);
  }
}

template <int kSlices>
__global__ void __launch_bounds__(fa::kThreadsPerBlock)
    dkv_kernel(FlashAttentionShape shape, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
               const __nv_bfloat16* __restrict__ v, const float* __restrict__ lse,
               const __nv_bfloat16* __restrict__ d_out, const float* __restrict__ delta,
               __nv_bfloat16* __restrict__ dk, __nv_bfloat16* __restrict__ dv) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  const int num_tokens = static_cast<int>(shape.num_tokens), num_q_heads = static_cast<int>(shape.num_q_heads);
  const int num_kv_heads = static_cast<int>(shape.num_kv_heads), head_dim = static_cast<int>(shape.head_dim);
  const int num_segments = static_cast<int>(shape.num_segments);
  const int group = num_q_heads / num_kv_heads;
  float* lse_tile = reinterpret_cast<float*>(shared_bytes);
  float* delta_tile = lse_tile + kQueryTile;
  __nv_bfloat16* q_tile = reinterpret_cast<__nv_bfloat16*>(delta_tile + kQueryTile);
  __nv_bfloat16* do_tile = q_tile + kQueryTile * head_dim;

  const int kv_head = blockIdx.y;
  const int row = threadIdx.x / fa::kThreadsPerRow, lane = threadIdx.x % fa::kThreadsPerRow;
  const int first_key = blockIdx.x * fa::kRowsPerBlock;
  const int last_key = min(first_key + fa::kRowsPerBlock, num_tokens) - 1;
  const int key = first_key + row;
  const bool row_valid = key < num_tokens;

  // Key j is seen by queries [causal ? j : segment.begin, segment.end) of its segment.
  const fa::Segment segment = fa::find_segment(shape.cu_seqlens, num_segments, row_valid ? key : last_key);
  const int query_from = shape.causal ? key : segment.begin;
  const int block_query_begin =
      shape.causal ? first_key : fa::find_segment(shape.cu_seqlens, num_segments, first_key).begin;
  const int block_query_end = fa::find_segment(shape.cu_seqlens, num_segments, last_key).end;

  float k_slice[kSlices], v_slice[kSlices], dk_acc[kSlices], dv_acc[kSlices];
  const int64_t row_offset = (static_cast<int64_t>(key) * num_kv_heads + kv_head) * head_dim;
#pragma unroll
  for (int c = 0; c < kSlices; ++c) {
    const int d = lane + fa::kThreadsPerRow * c;
    const bool in_row = row_valid && d < head_dim;
    k_slice[c] = in_row ? __bfloat162float(k[row_offset + d]) : 0.0f;
    v_slice[c] = in_row ? __bfloat162float(v[row_offset + d]) : 0.0f;
    dk_acc[c] = dv_acc[c] = 0.0f;
  }

  for (int head = kv_head * group; head < (kv_head + 1) * group; ++head) {
    for (int query0 = block_query_begin; query0 < block_query_end; query0 += kQueryTile) {
      __syncthreads();
      fa::load_rows(q_tile, q, query0, kQueryTile, block_query_end, num_q_heads, head, head_dim);
      fa::load_rows(do_tile, d_out, query0, kQueryTile, block_query_end, num_q_heads, head, head_dim);
      for (int i = threadIdx.x; i < kQueryTile; i += blockDim.x) {
        const int query = query0 + i;
        const bool valid = query < block_query_end;
        lse_tile[i] = valid ? lse[static_cast<int64_t>(query) * num_q_heads + head] : 0.0f;
        delta_tile[i] = valid ? delta[static_cast<int64_t>(query) * num_q_heads + head] : 0.0f;
      }
      __syncthreads();

      float prob[kQueryTile], d_score[kQueryTile];
#pragma unroll
      for (int i = 0; i < kQueryTile; ++i) {
        float qk = 0.0f, dov = 0.0f;
#pragma unroll
        for (int c = 0; c < kSlices; ++c) {
          const int d = lane + fa::kThreadsPerRow * c;
          if (d < head_dim) {
            qk += k_slice[c] * __bfloat162float(q_tile[i * head_dim + d]);
            dov += v_slice[c] * __bfloat162float(do_tile[i * head_dim + d]);
          }
        }
        qk = fa::row_sum(qk);
        dov = fa::row_sum(dov);
        const int query = query0 + i;
        const bool visible = row_valid && query >= query_from && query < segment.end;
        prob[i] = visible ? expf(qk * shape.scale - lse_tile[i]) : 0.0f;
        d_score[i] = prob[i] * (dov - delta_tile[i]);
      }
#pragma unroll
      for (int c = 0; c < kSlices; ++c) {
        const int d = lane + fa::kThreadsPerRow * c;
        if (d >= head_dim) continue;
        float dv_sum = 0.0f, dk_sum = 0.0f;
#pragma unroll
        for (int i = 0; i < kQueryTile; ++i) {
          dv_sum += prob[i] * __bfloat162float(do_tile[i * head_dim + d]);
          dk_sum += d_score[i] * __bfloat162float(q_tile[i * head_dim + d]);
        }
        dv_acc[c] += dv_sum;
        dk_acc[c] += dk_sum;
      }
    }
  }

  if (!row_valid) return;
#pragma unroll
  for (int c = 0; c < kSlices; ++c) {
    const int d = lane + fa::kThreadsPerRow * c;
    if (d < head_dim) {
      dk[row_offset + d] = __float2bfloat16(dk_acc[c] * shape.scale);
      dv[row_offset + d] = __float2bfloat16(dv_acc[c]);
    }
  }
}

template <int kSlices>
void launch_backward(const FlashAttentionShape& shape, const __nv_bfloat16* q, const __nv_bfloat16* k,
                     const __nv_bfloat16* v, const __nv_bfloat16* out, const float* lse, const __nv_bfloat16* d_out,
                     __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, float* delta, cudaStream_t stream) {
  const unsigned row_tiles = static_cast<unsigned>((shape.num_tokens + fa::kRowsPerBlock - 1) / fa::kRowsPerBlock);
  const size_t head_dim = static_cast<size_t>(shape.head_dim);
  const size_t dq_shared = 2 * kKeyTile * head_dim * sizeof(__nv_bfloat16);
  dq_kernel<kSlices><<<dim3(row_tiles, static_cast<unsigned>(shape.num_q_heads)), fa::kThreadsPerBlock, dq_shared,
                       stream>>>(shape, q, k, v, out, lse, d_out, dq, delta);
  CUDA_CHECK_LAUNCH();
  const size_t dkv_shared = 2 * kQueryTile * sizeof(float) + 2 * kQueryTile * head_dim * sizeof(__nv_bfloat16);
  dkv_kernel<kSlices><<<dim3(row_tiles, static_cast<unsigned>(shape.num_kv_heads)), fa::kThreadsPerBlock,
                        dkv_shared, stream>>>(shape, q, k, v, lse, d_out, delta, dk, dv);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t flash_attention_backward_workspace_bytes(const FlashAttentionShape& shape) {
  return static_cast<size_t>(shape.num_tokens) * static_cast<size_t>(shape.num_q_heads) * sizeof(float);
}

void flash_attention_backward_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                   const __nv_bfloat16* v, const __nv_bfloat16* out, const float* lse,
                                   const __nv_bfloat16* d_out, __nv_bfloat16* dq, __nv_bfloat16* dk,
                                   __nv_bfloat16* dv, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const auto aligned = [](const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
  const bool mma_aligned = aligned(q, 16) && aligned(k, 16) && aligned(v, 16) && aligned(d_out, 16) &&
                           aligned(dq, 4) && aligned(dk, 4) && aligned(dv, 4);
  if (flash_attention_wide_supported(shape) && mma_aligned && aligned(out, 16) &&
      aligned(lse, 4) && aligned(workspace, 4)) {
    flash_attention_backward_wide_cuda(shape, q, k, v, out, lse, d_out, dq, dk, dv, workspace, workspace_bytes,
                                       stream);
  } else if (flash_attention_backward_mma_supported(shape) && mma_aligned) {
    flash_attention_backward_mma_cuda(shape, q, k, v, out, lse, d_out, dq, dk, dv, workspace, workspace_bytes, stream);
  } else {
    flash_attention_backward_simt_cuda(shape, q, k, v, out, lse, d_out, dq, dk, dv, workspace, workspace_bytes,
                                       stream);
  }
}

void flash_attention_backward_simt_cuda(const FlashAttentionShape& shape, const __nv_bfloat16* q,
                                        const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* out,
                                        const float* lse, const __nv_bfloat16* d_out, __nv_bfloat16* dq,
                                        __nv_bfloat16* dk, __nv_bfloat16* dv, void* workspace, size_t workspace_bytes,
                                        cudaStream_t stream) {
  check_flash_attention_shape(shape, "flash_attention_backward_simt_cuda");
  fa::check_backward_workspace(shape, workspace_bytes, "flash_attention_backward_simt_cuda");
  if (shape.num_tokens == 0) return;
  CHECK(q && k && v && out && lse && d_out && dq && dk && dv && workspace,
        "flash_attention_backward_simt_cuda: null tensor or workspace pointer");
  float* delta = static_cast<float*>(workspace);
  if (shape.head_dim <= 64) {
    launch_backward<8>(shape, q, k, v, out, lse, d_out, dq, dk, dv, delta, stream);
  } else if (shape.head_dim <= 128) {
    launch_backward<16>(shape, q, k, v, out, lse, d_out, dq, dk, dv, delta, stream);
  } else {
    launch_backward<32>(shape, q, k, v, out, lse, d_out, dq, dk, dv, delta, stream);
  }
}

}  // namespace deltamoe
