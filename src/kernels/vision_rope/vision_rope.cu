// CUDA vision RoPE: a thread per (patch, angle) for the tables; the fused qkv rows to q, k, v (and
// back) in one pass with a thread per kVec channel pairs of a head, for q and k both (loads at c
// and c + D/2), and two kVec-value pieces of v; kVec = 4 (8-byte accesses) where every row and
// pointer allows.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/cuda_check.h"
#include "kernels/vision_rope/vision_rope_cuda.h"

namespace deltamoe {
namespace {

constexpr int kThreads = 256;

struct InverseFrequencies {
  float value[kVisionRopeMaxQuarter];
};

__global__ void vision_rope_tables_kernel(const int64_t* positions, int64_t num_patches, int64_t half,
                                          InverseFrequencies inv_freq, float* cos_out, float* sin_out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_patches * half) return;
  const int64_t n = i / half, c = i % half, quarter = half / 2;
  // First quarter of the angles from the row, second from the column (rotate_half layout).
  const float position = static_cast<float>(positions[n * 2 + (c < quarter ? 0 : 1)]);
  const float angle = position * inv_freq.value[c % quarter];
  cos_out[i] = cosf(angle);
  sin_out[i] = sinf(angle);
}

// kVec bf16 values moved as one aligned access.
template <int kVec>
struct Pack;
template <>
struct Pack<4> {
  using Raw = uint2;
};
template <>
struct Pack<2> {
  using Raw = uint32_t;
};
template <>
struct Pack<1> {
  using Raw = uint16_t;
};

template <int kVec>
__device__ __forceinline__ void load_floats(const __nv_bfloat16* p, float (&f)[kVec]) {
  const typename Pack<kVec>::Raw raw = *reinterpret_cast<const typename Pack<kVec>::Raw*>(p);
  __nv_bfloat16 h[kVec];
  memcpy(h, &raw, sizeof raw);
#pragma unroll
  for (int i = 0; i < kVec; ++i) f[i] = __bfloat162float(h[i]);
}

template <int kVec>
__device__ __forceinline__ void store_floats(__nv_bfloat16* p, const float (&f)[kVec]) {
  __nv_bfloat16 h[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) h[i] = __float2bfloat16_rn(f[i]);
  typename Pack<kVec>::Raw raw;
  memcpy(&raw, h, sizeof raw);
  *reinterpret_cast<typename Pack<kVec>::Raw*>(p) = raw;
}

template <int kVec>
__device__ __forceinline__ void load_table(const float* p, float (&f)[kVec]) {
  if constexpr (kVec == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    f[0] = t.x, f[1] = t.y, f[2] = t.z, f[3] = t.w;
  } else if constexpr (kVec == 2) {
    const float2 t = *reinterpret_cast<const float2*>(p);
    f[0] = t.x, f[1] = t.y;
  } else {
    f[0] = *p;
  }
}

// Both directions' pointers: the fused rows [N, 3, H, D] on one side, q / k [N, H, Dqk] and v [N,
// H, D] on the other. The forward reads `fused` and writes q, k, v; the backward the reverse.
struct QkvRopeParams {
  const __nv_bfloat16* fused_in;
  __nv_bfloat16* fused_out;
  int64_t fused_stride;
  const __nv_bfloat16 *q_in, *k_in, *v_in;
  __nv_bfloat16 *q_out, *k_out, *v_out;
  const float *cos, *sin;
  int64_t num_patches;
  int heads, head_dim, qk_head;
};

// A thread per (patch, head, kVec channel pairs (c, c + D/2)): the pairs of q and of k (the same
// angles: one read of the tables) and two of v's kVec-value pieces (v's H * D values are exactly
// 2 * H * G pieces, G = D / 2 / kVec), all loads issued before the stores. The forward's thread of
// a head's first pairs writes its zero padding.
template <int kVec, bool kForward>
__global__ void vision_qkv_rope_kernel(QkvRopeParams p) {
  using Raw = typename Pack<kVec>::Raw;
  const int half = p.head_dim / 2, groups = half / kVec, head_groups = p.heads * groups;
  const int64_t split_row = static_cast<int64_t>(p.heads) * p.qk_head;
  const int64_t v_row = static_cast<int64_t>(p.heads) * p.head_dim;
  const int64_t total = p.num_patches * head_groups;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / head_groups;
    const int r = static_cast<int>(i - n * head_groups);
    const int head = r / groups, c = (r % groups) * kVec;
    const int64_t fused_q = n * p.fused_stride + static_cast<int64_t>(head) * p.head_dim + c;
    const int64_t split_at = n * split_row + static_cast<int64_t>(head) * p.qk_head + c;
    const int64_t fused_v = n * p.fused_stride + 2 * v_row, split_v = n * v_row;
    const int64_t e0 = static_cast<int64_t>(r) * kVec, e1 = static_cast<int64_t>(r + head_groups) * kVec;
    const __nv_bfloat16* q_in = kForward ? p.fused_in + fused_q : p.q_in + split_at;
    const __nv_bfloat16* k_in = kForward ? p.fused_in + fused_q + v_row : p.k_in + split_at;
    const __nv_bfloat16* v_in = kForward ? p.fused_in + fused_v : p.v_in + split_v;
    float qa[kVec], qb[kVec], ka[kVec], kb[kVec], cs[kVec], sn[kVec];
    load_floats<kVec>(q_in, qa);
    load_floats<kVec>(q_in + half, qb);
    load_floats<kVec>(k_in, ka);
    load_floats<kVec>(k_in + half, kb);
    const Raw v0 = *reinterpret_cast<const Raw*>(v_in + e0), v1 = *reinterpret_cast<const Raw*>(v_in + e1);
    load_table<kVec>(p.cos + n * half + c, cs);
    load_table<kVec>(p.sin + n * half + c, sn);
    float out_qa[kVec], out_qb[kVec], out_ka[kVec], out_kb[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float s = kForward ? sn[j] : -sn[j];
      out_qa[j] = qa[j] * cs[j] - qb[j] * s;
      out_qb[j] = qb[j] * cs[j] + qa[j] * s;
      out_ka[j] = ka[j] * cs[j] - kb[j] * s;
      out_kb[j] = kb[j] * cs[j] + ka[j] * s;
    }
    __nv_bfloat16* q_out = kForward ? p.q_out + split_at : p.fused_out + fused_q;
    __nv_bfloat16* k_out = kForward ? p.k_out + split_at : p.fused_out + fused_q + v_row;
    __nv_bfloat16* v_out = kForward ? p.v_out + split_v : p.fused_out + fused_v;
    store_floats<kVec>(q_out, out_qa);
    store_floats<kVec>(q_out + half, out_qb);
    store_floats<kVec>(k_out, out_ka);
    store_floats<kVec>(k_out + half, out_kb);
    *reinterpret_cast<Raw*>(v_out + e0) = v0;
    *reinterpret_cast<Raw*>(v_out + e1) = v1;
    if (kForward && c == 0) {
      const float zeros[kVec] = {};
      for (int pad = p.head_dim; pad < p.qk_head; pad += kVec) {
        store_floats<kVec>(q_out + pad, zeros);
        store_floats<kVec>(k_out + pad, zeros);
      }
    }
  }
}

void check_head_dim(const char* where, int64_t head_dim) {
  CHECK(head_dim > 0 && head_dim % 4 == 0, where, ": head_dim ", head_dim, " must be a positive multiple of 4");
}

// The widest access (4, 2 or 1 values) every row, head, half-head and pointer is aligned to.
int vector_width(const QkvRopeParams& p) {
  for (int width : {4, 2}) {
    const uintptr_t bytes = static_cast<uintptr_t>(width) * sizeof(__nv_bfloat16);
    bool ok = (p.head_dim / 2) % width == 0 && p.qk_head % width == 0 && p.fused_stride % width == 0;
    for (const void* ptr : {static_cast<const void*>(p.fused_in), static_cast<const void*>(p.fused_out),
                            static_cast<const void*>(p.q_in), static_cast<const void*>(p.k_in),
                            static_cast<const void*>(p.v_in), static_cast<const void*>(p.q_out),
                            static_cast<const void*>(p.k_out), static_cast<const void*>(p.v_out)})
      ok = ok && reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
    if (ok) return width;
  }
  return 1;
}

template <bool kForward>
void launch_qkv_rope(const char* where, QkvRopeParams p, int64_t num_heads, int64_t head_dim, int64_t qk_head_stride,
                     cudaStream_t stream) {
  check_head_dim(where, head_dim);
  CHECK(p.num_patches >= 0 && num_heads > 0, where, ": bad size patches ", p.num_patches, ", heads ", num_heads);
  if (qk_head_stride == 0) qk_head_stride = head_dim;
  CHECK(qk_head_stride >= head_dim, where, ": q/k head stride ", qk_head_stride, " must be 0 or at least head_dim ",
        head_dim);
  CHECK(p.fused_stride >= 3 * num_heads * head_dim, where, ": qkv patch stride ", p.fused_stride, " must cover ",
        3 * num_heads, " heads of ", head_dim);
  CHECK(num_heads * head_dim < (int64_t{1} << 30), where, ": ", num_heads, " heads of ", head_dim,
        " are too many values for a row");
  if (p.num_patches == 0) return;
  CHECK(p.cos != nullptr && p.sin != nullptr, where, ": null rope tables");
  p.heads = static_cast<int>(num_heads);
  p.head_dim = static_cast<int>(head_dim);
  p.qk_head = static_cast<int>(qk_head_stride);
  const int width = vector_width(p);
  const int64_t threads = p.num_patches * num_heads * (head_dim / 2 / width);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((threads + kThreads - 1) / kThreads, int64_t{1} << 20)));
  const dim3 block(kThreads);
  if (width == 4) {
    vision_qkv_rope_kernel<4, kForward><<<grid, block, 0, stream>>>(p);
  } else if (width == 2) {
    vision_qkv_rope_kernel<2, kForward><<<grid, block, 0, stream>>>(p);
  } else {
    vision_qkv_rope_kernel<1, kForward><<<grid, block, 0, stream>>>(p);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void vision_rope_tables_cuda(const int64_t* positions, int64_t num_patches, int64_t head_dim, double theta,
                             float* cos, float* sin, cudaStream_t stream) {
  check_head_dim("vision_rope_tables_cuda", head_dim);
  CHECK(head_dim / 4 <= kVisionRopeMaxQuarter, "vision_rope_tables_cuda: head_dim ", head_dim, " above the ",
        4 * kVisionRopeMaxQuarter, " the table kernel takes");
  CHECK(theta > 0, "vision_rope_tables_cuda: theta must be > 0, got ", theta);
  CHECK(num_patches >= 0, "vision_rope_tables_cuda: bad patch count ", num_patches);
  if (num_patches == 0) return;
  const int64_t half = head_dim / 2, quarter = head_dim / 4;
  InverseFrequencies inv_freq{};
  for (int64_t j = 0; j < quarter; ++j) {
    // The reference's fp32 expression, term by term, so that both sides hold the same floats.
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(half);
    inv_freq.value[j] = 1.0f / std::pow(static_cast<float>(theta), exponent);
  }
  const int64_t total = num_patches * half;
  vision_rope_tables_kernel<<<static_cast<unsigned>((total + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      positions, num_patches, half, inv_freq, cos, sin);
  CUDA_CHECK_LAUNCH();
}

void vision_qkv_rope_forward_cuda(const __nv_bfloat16* qkv, int64_t qkv_patch_stride, __nv_bfloat16* q,
                                  __nv_bfloat16* k, __nv_bfloat16* v, const float* cos, const float* sin,
                                  int64_t num_patches, int64_t num_heads, int64_t head_dim, int64_t qk_head_stride,
                                  cudaStream_t stream) {
  QkvRopeParams p{};
  p.fused_in = qkv;
  p.fused_stride = qkv_patch_stride;
  p.q_out = q, p.k_out = k, p.v_out = v;
  p.cos = cos, p.sin = sin;
  p.num_patches = num_patches;
  launch_qkv_rope<true>("vision_qkv_rope_forward_cuda", p, num_heads, head_dim, qk_head_stride, stream);
}

void vision_qkv_rope_backward_cuda(const __nv_bfloat16* dq, const __nv_bfloat16* dk, const __nv_bfloat16* dv,
                                   __nv_bfloat16* d_qkv, int64_t d_qkv_patch_stride, const float* cos,
                                   const float* sin, int64_t num_patches, int64_t num_heads, int64_t head_dim,
                                   int64_t qk_head_stride, cudaStream_t stream) {
  QkvRopeParams p{};
  p.fused_out = d_qkv;
  p.fused_stride = d_qkv_patch_stride;
  p.q_in = dq, p.k_in = dk, p.v_in = dv;
  p.cos = cos, p.sin = sin;
  p.num_patches = num_patches;
  launch_qkv_rope<false>("vision_qkv_rope_backward_cuda", p, num_heads, head_dim, qk_head_stride, stream);
}

}  // namespace deltamoe
