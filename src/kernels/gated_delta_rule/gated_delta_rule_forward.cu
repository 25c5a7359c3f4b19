// CUDA forward of the chunked gated delta rule: chunk table, per-chunk UT/WY preparation
// (A = (I + L)^-1, W, U, P), the sequential state scan over chunks (column slices of the state in
// parallel) and the chunk outputs. Plain fp32 FMA version: correct first, tensor cores next.
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/gated_delta_rule/gated_delta_rule_cuda.h"
#include "kernels/gated_delta_rule/gated_delta_rule_internal.cuh"

namespace deltamoe {
namespace gdn_cuda {
namespace {

size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

// One block: thread 0 counts chunks per sequence, then all threads fill the table.
__global__ void build_chunk_table_kernel(const int32_t* cu_seqlens, int num_seqs,
                                         ChunkInfo* chunks, int* chunk_count,
                                         int* chunk_offsets) {
  if (threadIdx.x == 0) {
    int total = 0;
    for (int n = 0; n < num_seqs; ++n) {
      chunk_offsets[n] = total;
      total += (cu_seqlens[n + 1] - cu_seqlens[n] + kChunk - 1) / kChunk;
    }
    chunk_offsets[num_seqs] = total;
    *chunk_count = total;
  }
  __syncthreads();
  for (int n = threadIdx.x; n < num_seqs; n += blockDim.x) {
    const int begin = cu_seqlens[n], end = cu_seqlens[n + 1];
    int c = chunk_offsets[n];
    for (int t0 = begin; t0 < end; t0 += kChunk, ++c) {
      chunks[c] = ChunkInfo{t0, min(kChunk, end - t0), n, 0};
    }
  }
}

// Shared memory of the preparation kernel: K and scale*Q rows (padded by one float against bank
// conflicts), L and A (64 x 64), gamma and beta.
size_t prepare_smem_bytes(int key_dim) {
  return sizeof(float) * (2 * kChunk * (key_dim + 1) + 2 * kChunk * kChunk + 2 * kChunk);
}

// Grid (max_chunks, Hv). Builds gamma, P, A, W and U of one chunk and head.
__global__ void __launch_bounds__(kThreads)
    prepare_chunks_kernel(GatedDeltaRuleShape s, float scale, const __nv_bfloat16* q,
                          const __nv_bfloat16* k, const __nv_bfloat16* v, const float* g,
                          const float* beta, Workspace ws) {
  const int chunk = blockIdx.x, h = blockIdx.y;
  if (chunk >= *ws.chunk_count) return;
  const ChunkInfo ci = ws.chunks[chunk];
  const int Dk = s.key_dim, Dv = s.value_dim, Hk = s.num_key_heads, Hv = s.num_value_heads;
  const int kh = key_head_of(s, h), len = ci.len, stride = Dk + 1, tid = threadIdx.x;
  extern __shared__ float smem[];
  float* ks = smem;                          // [64][Dk+1]
  float* qs = ks + kChunk * stride;          // [64][Dk+1] scale * q
  float* lm = qs + kChunk * stride;          // [64][64] L (strict lower)
  float* am = lm + kChunk * kChunk;          // [64][64] A
  float* gam = am + kChunk * kChunk;         // [64]
  float* bet = gam + kChunk;                 // [64]

  for (int idx = tid; idx < len * Dk; idx += kThreads) {
    const int i = idx / Dk, d = idx % Dk;
    const int64_t src = (static_cast<int64_t>(ci.t0 + i) * Hk + kh) * Dk + d;
    ks[i * stride + d] = __bfloat162float(k[src]);
    qs[i * stride + d] = scale * __bfloat162float(q[src]);
  }
  for (int i = tid; i < len; i += kThreads) {
    gam[i] = g[static_cast<int64_t>(ci.t0 + i) * Hv + h];
    bet[i] = beta[static_cast<int64_t>(ci.t0 + i) * Hv + h];
  }
  __syncthreads();
  if (tid == 0) {
    float running = 0.0f;
    for (int i = 0; i < len; ++i) {
      running += gam[i];
      gam[i] = running;
      ws.gamma[static_cast<int64_t>(ci.t0 + i) * Hv + h] = running;
    }
  }
  __syncthreads();
  // L_ij = beta_i (k_i . k_j) e^(gamma_i - gamma_j) for i > j; P_ij = (scale q_i . k_j) e^(..).
  float* p_out = ws.p + (static_cast<int64_t>(chunk) * Hv + h) * kChunk * kChunk;
  for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) {
    const int i = idx / kChunk, j = idx % kChunk;
    float l_value = 0.0f, p_value = 0.0f;
    if (i < len && j <= i) {
      float kk = 0.0f, qk = 0.0f;
      for (int d = 0; d < Dk; ++d) {
        kk += ks[i * stride + d] * ks[j * stride + d];
        qk += qs[i * stride + d] * ks[j * stride + d];
      }
      const float decay = expf(gam[i] - gam[j]);
      if (j < i) l_value = bet[i] * kk * decay;
      p_value = qk * decay;
    }
    lm[idx] = l_value;
    p_out[idx] = p_value;
    am[idx] = i == j ? 1.0f : 0.0f;
  }
  // A = (I + L)^-1 by forward substitution, one row at a time: A_ij = -sum_{j<=m<i} L_im A_mj.
  for (int i = 1; i < len; ++i) {
    __syncthreads();
    for (int j = tid; j < i; j += kThreads) {
      float sum = 0.0f;
      for (int m = j; m < i; ++m) sum += lm[i * kChunk + m] * am[m * kChunk + j];
      am[i * kChunk + j] = -sum;
    }
  }
  __syncthreads();
  float* a_out = ws.a_inv + (static_cast<int64_t>(chunk) * Hv + h) * kChunk * kChunk;
  for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) a_out[idx] = am[idx];
  // W = A diag(beta e^gamma) K and U = A diag(beta) V (A lower triangular: j <= i).
  for (int idx = tid; idx < len * Dk; idx += kThreads) {
    const int i = idx / Dk, d = idx % Dk;
    float sum = 0.0f;
    for (int j = 0; j <= i; ++j) sum += am[i * kChunk + j] * bet[j] * expf(gam[j]) * ks[j * stride + d];
    ws.w[(static_cast<int64_t>(ci.t0 + i) * Hv + h) * Dk + d] = sum;
  }
  for (int idx = tid; idx < len * Dv; idx += kThreads) {
    const int i = idx / Dv, e = idx % Dv;
    float sum = 0.0f;
    for (int j = 0; j <= i; ++j) {
      sum += am[i * kChunk + j] * bet[j] *
             __bfloat162float(v[(static_cast<int64_t>(ci.t0 + j) * Hv + h) * Dv + e]);
    }
    ws.v_new[(static_cast<int64_t>(ci.t0 + i) * Hv + h) * Dv + e] = sum;
  }
}

// Grid (N, Hv, ceil(Dv / kScanColumns)). Carries a column slice of one head's state through the
// chunks of one sequence (columns of the state evolve independently): stores the state entering
// each chunk, turns U into V_new = U - W H, and advances H.
__global__ void __launch_bounds__(kThreads)
    state_scan_kernel(GatedDeltaRuleShape s, const __nv_bfloat16* k, const float* initial_state,
                      float* final_state, Workspace ws) {
  const int n = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * kScanColumns;
  const int Dk = s.key_dim, Dv = s.value_dim, Hk = s.num_key_heads, Hv = s.num_value_heads;
  const int kh = key_head_of(s, h), tid = threadIdx.x;
  const int cols = min(kScanColumns, Dv - col0);
  __shared__ float hs[kGatedDeltaRuleCudaMaxHeadDim * kScanColumns];
  __shared__ float vn[kChunk * (kScanColumns + 1)];
  __shared__ float to_end[kChunk];
  __shared__ float chunk_decay;
  const int64_t state_base = (static_cast<int64_t>(n) * Hv + h) * Dk * Dv;
  for (int idx = tid; idx < Dk * kScanColumns; idx += kThreads) {
    const int d = idx / kScanColumns, e = idx % kScanColumns;
    hs[idx] = (initial_state != nullptr && e < cols) ? initial_state[state_base + d * Dv + col0 + e]
                                                     : 0.0f;
  }
  const int first = ws.chunk_offsets[n], last = ws.chunk_offsets[n + 1];
  for (int c = first; c < last; ++c) {
    const ChunkInfo ci = ws.chunks[c];
    const int len = ci.len;
    __syncthreads();
    float* h_out = ws.h + (static_cast<int64_t>(c) * Hv + h) * Dk * Dv;
    for (int idx = tid; idx < Dk * kScanColumns; idx += kThreads) {
      const int d = idx / kScanColumns, e = idx % kScanColumns;
      if (e < cols) h_out[d * Dv + col0 + e] = hs[idx];
    }
    if (tid < len) {
      const float g_last = ws.gamma[static_cast<int64_t>(ci.t0 + len - 1) * Hv + h];
      to_end[tid] = expf(g_last - ws.gamma[static_cast<int64_t>(ci.t0 + tid) * Hv + h]);
      if (tid == 0) chunk_decay = expf(g_last);
    }
    for (int idx = tid; idx < len * kScanColumns; idx += kThreads) {
      const int i = idx / kScanColumns, e = idx % kScanColumns;
      if (e >= cols) continue;
      const int64_t row = static_cast<int64_t>(ci.t0 + i) * Hv + h;
      const float* w_row = ws.w + row * Dk;
      float sum = 0.0f;
      for (int d = 0; d < Dk; ++d) sum += w_row[d] * hs[d * kScanColumns + e];
      const float value = ws.v_new[row * Dv + col0 + e] - sum;
      vn[i * (kScanColumns + 1) + e] = value;
      ws.v_new[row * Dv + col0 + e] = value;
    }
    __syncthreads();
    // H <- e^gamma_last H + sum_j e^(gamma_last - gamma_j) k_j v_new_j^T.
    for (int idx = tid; idx < Dk * kScanColumns; idx += kThreads) {
      const int d = idx / kScanColumns, e = idx % kScanColumns;
      if (e >= cols) continue;  // columns past Dv stay zero
      float sum = chunk_decay * hs[idx];
      for (int j = 0; j < len; ++j) {
        const float kd = __bfloat162float(k[(static_cast<int64_t>(ci.t0 + j) * Hk + kh) * Dk + d]);
        sum += to_end[j] * kd * vn[j * (kScanColumns + 1) + e];
      }
      hs[idx] = sum;
    }
  }
  __syncthreads();
  if (final_state != nullptr) {
    for (int idx = tid; idx < Dk * kScanColumns; idx += kThreads) {
      const int d = idx / kScanColumns, e = idx % kScanColumns;
      if (e < cols) final_state[state_base + d * Dv + col0 + e] = hs[idx];
    }
  }
}

size_t output_smem_bytes(int key_dim) {
  return sizeof(float) * (kChunk * (key_dim + 1) + kChunk * kChunk + kChunk);
}

// Grid (max_chunks, Hv): o_i = e^gamma_i (scale q_i)^T H + sum_{j<=i} P_ij v_new_j.
__global__ void __launch_bounds__(kThreads)
    output_kernel(GatedDeltaRuleShape s, float scale, const __nv_bfloat16* q, Workspace ws,
                  __nv_bfloat16* o) {
  const int chunk = blockIdx.x, h = blockIdx.y;
  if (chunk >= *ws.chunk_count) return;
  const ChunkInfo ci = ws.chunks[chunk];
  const int Dk = s.key_dim, Dv = s.value_dim, Hk = s.num_key_heads, Hv = s.num_value_heads;
  const int kh = key_head_of(s, h), len = ci.len, stride = Dk + 1, tid = threadIdx.x;
  extern __shared__ float smem[];
  float* qs = smem;                    // [64][Dk+1]
  float* ps = qs + kChunk * stride;    // [64][64]
  float* e_gam = ps + kChunk * kChunk;  // [64]
  for (int idx = tid; idx < len * Dk; idx += kThreads) {
    const int i = idx / Dk, d = idx % Dk;
    qs[i * stride + d] =
        scale * __bfloat162float(q[(static_cast<int64_t>(ci.t0 + i) * Hk + kh) * Dk + d]);
  }
  const float* p_in = ws.p + (static_cast<int64_t>(chunk) * Hv + h) * kChunk * kChunk;
  for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) ps[idx] = p_in[idx];
  for (int i = tid; i < len; i += kThreads) {
    e_gam[i] = expf(ws.gamma[static_cast<int64_t>(ci.t0 + i) * Hv + h]);
  }
  __syncthreads();
  const float* state = ws.h + (static_cast<int64_t>(chunk) * Hv + h) * Dk * Dv;
  for (int idx = tid; idx < len * Dv; idx += kThreads) {
    const int i = idx / Dv, e = idx % Dv;
    float inter = 0.0f;
    for (int d = 0; d < Dk; ++d) inter += qs[i * stride + d] * state[d * Dv + e];
    float intra = 0.0f;
    for (int j = 0; j <= i; ++j) {
      intra += ps[i * kChunk + j] * ws.v_new[(static_cast<int64_t>(ci.t0 + j) * Hv + h) * Dv + e];
    }
    o[(static_cast<int64_t>(ci.t0 + i) * Hv + h) * Dv + e] =
        __float2bfloat16(e_gam[i] * inter + intra);
  }
}

// Raises a kernel's dynamic shared memory limit when it needs more than the default 48 KB.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  int device = 0, limit = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  CHECK(bytes <= static_cast<size_t>(limit), "gated_delta_rule_cuda: needs ", bytes,
        " bytes of shared memory per block, the device allows ", limit);
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)));
}

}  // namespace

size_t carve_workspace(const GatedDeltaRuleShape& s, bool backward, void* base, Workspace* out) {
  const int64_t chunks = max_chunks(s);
  const int64_t T = s.num_tokens, Hv = s.num_value_heads, Dk = s.key_dim, Dv = s.value_dim;
  size_t offset = 0;
  auto* bytes = static_cast<char*>(base);
  auto take = [&](size_t size) -> void* {
    void* p = base == nullptr ? nullptr : bytes + offset;
    offset += align_up(size);
    return p;
  };
  Workspace ws{};
  ws.chunks = static_cast<ChunkInfo*>(take(sizeof(ChunkInfo) * chunks));
  ws.chunk_count = static_cast<int*>(take(sizeof(int)));
  ws.chunk_offsets = static_cast<int*>(take(sizeof(int) * (s.num_seqs + 1)));
  ws.gamma = static_cast<float*>(take(sizeof(float) * T * Hv));
  ws.w = static_cast<float*>(take(sizeof(float) * T * Hv * Dk));
  ws.v_new = static_cast<float*>(take(sizeof(float) * T * Hv * Dv));
  ws.p = static_cast<float*>(take(sizeof(float) * chunks * Hv * kChunk * kChunk));
  ws.a_inv = static_cast<float*>(take(sizeof(float) * chunks * Hv * kChunk * kChunk));
  ws.h = static_cast<float*>(take(sizeof(float) * chunks * Hv * Dk * Dv));
  if (backward) {
    ws.dh = static_cast<float*>(take(sizeof(float) * chunks * Hv * Dk * Dv));
    ws.dv_new = static_cast<float*>(take(sizeof(float) * T * Hv * Dv));
    ws.dq_acc = static_cast<float*>(take(sizeof(float) * T * Hv * Dk));
    ws.dk_acc = static_cast<float*>(take(sizeof(float) * T * Hv * Dk));
    ws.dgamma = static_cast<float*>(take(sizeof(float) * T * Hv));
  }
  if (out != nullptr) *out = ws;
  return offset;
}

void check_shape(const char* op, const GatedDeltaRuleShape& s) {
  CHECK(s.cu_seqlens != nullptr, op, ": cu_seqlens is null");
  CHECK(s.num_seqs >= 1, op, ": need at least one sequence, got num_seqs=", s.num_seqs);
  CHECK(s.num_tokens >= 0 && s.num_tokens < (int64_t{1} << 31), op,
        ": num_tokens must be in [0, 2^31), got ", s.num_tokens);
  CHECK(s.num_key_heads > 0 && s.num_value_heads > 0 && s.num_value_heads <= 65535, op,
        ": head counts must be positive (Hv <= 65535), got Hk=", s.num_key_heads,
        " Hv=", s.num_value_heads);
  CHECK(s.num_value_heads % s.num_key_heads == 0, op, ": value heads Hv=", s.num_value_heads,
        " must be a multiple of key heads Hk=", s.num_key_heads);
  CHECK(s.key_dim > 0 && s.key_dim <= kGatedDeltaRuleCudaMaxHeadDim && s.value_dim > 0 &&
            s.value_dim <= kGatedDeltaRuleCudaMaxHeadDim,
        op, ": head dims must be in [1, ", kGatedDeltaRuleCudaMaxHeadDim, "], got Dk=", s.key_dim,
        " Dv=", s.value_dim);
}

void launch_build_chunk_table(const GatedDeltaRuleShape& s, const Workspace& ws,
                              cudaStream_t stream) {
  build_chunk_table_kernel<<<1, kThreads, 0, stream>>>(s.cu_seqlens, s.num_seqs, ws.chunks,
                                                       ws.chunk_count, ws.chunk_offsets);
  CUDA_CHECK_LAUNCH();
}

void launch_prepare_chunks(const GatedDeltaRuleShape& s, float scale, const __nv_bfloat16* q,
                           const __nv_bfloat16* k, const __nv_bfloat16* v, const float* g,
                           const float* beta, const Workspace& ws, cudaStream_t stream) {
  const size_t smem = prepare_smem_bytes(s.key_dim);
  allow_smem(prepare_chunks_kernel, smem);
  const dim3 grid(static_cast<unsigned>(max_chunks(s)), s.num_value_heads);
  prepare_chunks_kernel<<<grid, kThreads, smem, stream>>>(s, scale, q, k, v, g, beta, ws);
  CUDA_CHECK_LAUNCH();
}

void launch_state_scan(const GatedDeltaRuleShape& s, const __nv_bfloat16* k,
                       const float* initial_state, float* final_state, const Workspace& ws,
                       cudaStream_t stream) {
  const dim3 grid(s.num_seqs, s.num_value_heads,
                  (s.value_dim + kScanColumns - 1) / kScanColumns);
  state_scan_kernel<<<grid, kThreads, 0, stream>>>(s, k, initial_state, final_state, ws);
  CUDA_CHECK_LAUNCH();
}

void launch_output(const GatedDeltaRuleShape& s, float scale, const __nv_bfloat16* q,
                   const Workspace& ws, __nv_bfloat16* o, cudaStream_t stream) {
  const size_t smem = output_smem_bytes(s.key_dim);
  allow_smem(output_kernel, smem);
  const dim3 grid(static_cast<unsigned>(max_chunks(s)), s.num_value_heads);
  output_kernel<<<grid, kThreads, smem, stream>>>(s, scale, q, ws, o);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gdn_cuda

size_t gated_delta_rule_forward_workspace_bytes(const GatedDeltaRuleShape& shape) {
  return gdn_cuda::carve_workspace(shape, false, nullptr, nullptr);
}

void gated_delta_rule_forward_cuda(const GatedDeltaRuleShape& shape, float scale,
                                   const __nv_bfloat16* q, const __nv_bfloat16* k,
                                   const __nv_bfloat16* v, const float* g, const float* beta,
                                   const float* initial_state, __nv_bfloat16* o,
                                   float* final_state, void* workspace, size_t workspace_bytes,
                                   cudaStream_t stream) {
  using namespace gdn_cuda;
  check_shape("gated_delta_rule_forward_cuda", shape);
  const size_t needed = gated_delta_rule_forward_workspace_bytes(shape);
  CHECK(workspace != nullptr && workspace_bytes >= needed,
        "gated_delta_rule_forward_cuda: workspace of ", workspace_bytes, " bytes, need ", needed);
  Workspace ws{};
  carve_workspace(shape, false, workspace, &ws);
  launch_build_chunk_table(shape, ws, stream);
  // An empty batch still writes the final states (= initial states) below, so no early return.
  if (shape.num_tokens > 0) launch_prepare_chunks(shape, scale, q, k, v, g, beta, ws, stream);
  launch_state_scan(shape, k, initial_state, final_state, ws, stream);
  if (shape.num_tokens > 0) launch_output(shape, scale, q, ws, o, stream);
}

}  // namespace deltamoe
