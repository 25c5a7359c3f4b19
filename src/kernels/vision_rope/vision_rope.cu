// CUDA vision RoPE: a thread per (patch, angle) for the tables; the fused qkv rows to q, k, v (and
// back) in one pass with a thread per kVec channel pairs of a q or k head (loads at c and c + D/2)
// or kVec values of v, kVec = 4 (8-byte accesses) where every row and pointer allows.
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

// A patch row per threadIdx.y (rows grid-strided), its units on threadIdx.x: H * G rotation units
// of q, then of k (G = D / 2 / kVec: kVec channel pairs (c, c + D/2) each), then H * D / kVec
// copy units of v. The forward's first rotation unit of a head writes its zero padding.
template <int kVec, bool kForward>
__global__ void vision_qkv_rope_kernel(QkvRopeParams p) {
  const int half = p.head_dim / 2, groups = half / kVec;
  const int rotation_units = p.heads * groups, units = 2 * rotation_units + p.heads * p.head_dim / kVec;
  const int64_t split_row = static_cast<int64_t>(p.heads) * p.qk_head, v_row = static_cast<int64_t>(p.heads) * p.head_dim;
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; n < p.num_patches;
       n += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    const int64_t fused_row = n * p.fused_stride;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      if (u >= 2 * rotation_units) {  // v: a raw copy
        const int64_t e = static_cast<int64_t>(u - 2 * rotation_units) * kVec;
        using Raw = typename Pack<kVec>::Raw;
        if constexpr (kForward) {
          *reinterpret_cast<Raw*>(p.v_out + n * v_row + e) =
              *reinterpret_cast<const Raw*>(p.fused_in + fused_row + 2 * v_row + e);
        } else {
          *reinterpret_cast<Raw*>(p.fused_out + fused_row + 2 * v_row + e) =
              *reinterpret_cast<const Raw*>(p.v_in + n * v_row + e);
        }
        continue;
      }
      const bool is_k = u >= rotation_units;
      const int r = is_k ? u - rotation_units : u;
      const int head = r / groups, c = (r % groups) * kVec;
      const int64_t fused_at = fused_row + (is_k ? v_row : 0) + static_cast<int64_t>(head) * p.head_dim + c;
      const int64_t split_at = n * split_row + static_cast<int64_t>(head) * p.qk_head + c;
      const __nv_bfloat16* in = kForward ? p.fused_in + fused_at : (is_k ? p.k_in : p.q_in) + split_at;
      __nv_bfloat16* out = kForward ? (is_k ? p.k_out : p.q_out) + split_at : p.fused_out + fused_at;
      float a[kVec], b[kVec], cs[kVec], sn[kVec];
      load_floats<kVec>(in, a);
      load_floats<kVec>(in + half, b);
      load_table<kVec>(p.cos + n * half + c, cs);
      load_table<kVec>(p.sin + n * half + c, sn);
      float out_a[kVec], out_b[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float s = kForward ? sn[i] : -sn[i];
        out_a[i] = a[i] * cs[i] - b[i] * s;
        out_b[i] = b[i] * cs[i] + a[i] * s;
      }
      store_floats<kVec>(out, out_a);
      store_floats<kVec>(out + half, out_b);
      if (kForward && c == 0) {
        float zeros[kVec] = {};
        for (int pad = p.head_dim; pad < p.qk_head; pad += kVec) store_floats<kVec>(out - c + pad, zeros);
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
  CHECK(2 * num_heads * (head_dim / 2) + num_heads * head_dim < (int64_t{1} << 30), where, ": ", num_heads,
        " heads of ", head_dim, " are too many for one row's units");
  if (p.num_patches == 0) return;
  CHECK(p.cos != nullptr && p.sin != nullptr, where, ": null rope tables");
  p.heads = static_cast<int>(num_heads);
  p.head_dim = static_cast<int>(head_dim);
  p.qk_head = static_cast<int>(qk_head_stride);
  const int width = vector_width(p);
  const int64_t units = 2 * num_heads * (head_dim / 2) / width + num_heads * head_dim / width;
  const int threads_x = static_cast<int>(std::min<int64_t>(1024, (units + 31) / 32 * 32));
  const int rows_per_block = std::max(1, kThreads / threads_x);
  const int64_t blocks = std::min<int64_t>((p.num_patches + rows_per_block - 1) / rows_per_block, int64_t{1} << 30);
  const dim3 block(static_cast<unsigned>(threads_x), static_cast<unsigned>(rows_per_block));
  const dim3 grid(static_cast<unsigned>(blocks));
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
