// CUDA backward of the chunked gated delta rule, following chunk_backward in the chunked CPU
// reference: recompute the forward chunk quantities and states, a reverse scan over chunks for
// dL/dH and dV_new, then chunk-local gradients. Plain fp32 FMA version: correct first.
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/gated_delta_rule/gated_delta_rule_cuda.h"
#include "kernels/gated_delta_rule/gated_delta_rule_internal.cuh"

namespace deltamoe {
namespace gdn_cuda {
namespace {

constexpr int kColumnStride = kScanColumns + 1;  // padded rows of the 64-token column slices

// Grid (N, Hv, ceil(Dv / kScanColumns)). Reverse scan over the chunks of one sequence carrying a
// column slice of dL/dH. Per chunk (last first): stores dH leaving the chunk, then
//   dV_new_j = sum_{i>=j} P_ij do_i + e^(gamma_last - gamma_j) dH^T k_j,
//   dH <- e^gamma_last dH + sum_i e^gamma_i (scale q_i) do_i^T - W^T dV_new.
__global__ void __launch_bounds__(kThreads)
    dstate_scan_kernel(GatedDeltaRuleShape s, float scale, const __nv_bfloat16* q,
                       const __nv_bfloat16* k, const __nv_bfloat16* d_o,
                       const float* d_final_state, float* d_initial_state, Workspace ws) {
  const int n = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * kScanColumns;
  const int Dk = s.key_dim, Dv = s.value_dim, Hk = s.num_key_heads, Hv = s.num_value_heads;
  const int kh = key_head_of(s, h), tid = threadIdx.x;
  const int cols = min(kScanColumns, Dv - col0);
  __shared__ float dhs[kGatedDeltaRuleCudaMaxHeadDim * kScanColumns];
  __shared__ float dvn[kChunk * kColumnStride];
  __shared__ float to_end[kChunk];
  __shared__ float e_gam[kChunk];
  __shared__ float chunk_decay;
  const int64_t state_base = (static_cast<int64_t>(n) * Hv + h) * Dk * Dv;
  for (int idx = tid; idx < Dk * kScanColumns; idx += kThreads) {
    const int d = idx / kScanColumns, e = idx % kScanColumns;
    dhs[idx] = (d_final_state != nullptr && e < cols)
                   ? d_final_state[state_base + d * Dv + col0 + e]
                   : 0.0f;
  }
  const int first = ws.chunk_offsets[n], last = ws.chunk_offsets[n + 1];
  for (int c = last - 1; c >= first; --c) {
    const ChunkInfo ci = ws.chunks[c];
    const int len = ci.len;
    __syncthreads();
    float* dh_out = ws.dh + (static_cast<int64_t>(c) * Hv + h) * Dk * Dv;
    for (int idx = tid; idx < Dk * kScanColumns; idx += kThreads) {
      const int d = idx / kScanColumns, e = idx % kScanColumns;
      if (e < cols) dh_out[d * Dv + col0 + e] = dhs[idx];
    }
    if (tid < len) {
      const float g_last = ws.gamma[static_cast<int64_t>(ci.t0 + len - 1) * Hv + h];
      const float g_i = ws.gamma[static_cast<int64_t>(ci.t0 + tid) * Hv + h];
      to_end[tid] = expf(g_last - g_i);
      e_gam[tid] = expf(g_i);
      if (tid == 0) chunk_decay = expf(g_last);
    }
    __syncthreads();
    const float* p_in = ws.p + (static_cast<int64_t>(c) * Hv + h) * kChunk * kChunk;
    for (int idx = tid; idx < len * kScanColumns; idx += kThreads) {
      const int j = idx / kScanColumns, e = idx % kScanColumns;
      if (e >= cols) continue;
      float from_outputs = 0.0f;
      for (int i = j; i < len; ++i) {
        from_outputs += p_in[i * kChunk + j] *
                        __bfloat162float(d_o[(static_cast<int64_t>(ci.t0 + i) * Hv + h) * Dv +
                                             col0 + e]);
      }
      const __nv_bfloat16* k_row = k + (static_cast<int64_t>(ci.t0 + j) * Hk + kh) * Dk;
      float from_state = 0.0f;
      for (int d = 0; d < Dk; ++d) from_state += __bfloat162float(k_row[d]) * dhs[d * kScanColumns + e];
      const float value = from_outputs + to_end[j] * from_state;
      dvn[j * kColumnStride + e] = value;
      ws.dv_new[(static_cast<int64_t>(ci.t0 + j) * Hv + h) * Dv + col0 + e] = value;
    }
    __syncthreads();
    for (int idx = tid; idx < Dk * kScanColumns; idx += kThreads) {
      const int d = idx / kScanColumns, e = idx % kScanColumns;
      if (e >= cols) continue;
      float sum = chunk_decay * dhs[idx];
      for (int i = 0; i < len; ++i) {
        const int64_t row = static_cast<int64_t>(ci.t0 + i) * Hv + h;
        const float qd =
            scale * __bfloat162float(q[(static_cast<int64_t>(ci.t0 + i) * Hk + kh) * Dk + d]);
        sum += e_gam[i] * qd * __bfloat162float(d_o[row * Dv + col0 + e]);
        sum -= ws.w[row * Dk + d] * dvn[i * kColumnStride + e];
      }
      dhs[idx] = sum;
    }
  }
  __syncthreads();
  if (d_initial_state != nullptr) {
    for (int idx = tid; idx < Dk * kScanColumns; idx += kThreads) {
      const int d = idx / kScanColumns, e = idx % kScanColumns;
      if (e < cols) d_initial_state[state_base + d * Dv + col0 + e] = dhs[idx];
    }
  }
}

constexpr int kStateTileRows = 32;  // rows of H and dH staged in shared memory at a time

size_t grads_states_smem_bytes(int value_dim) {
  return sizeof(float) * (3 * kChunk * (value_dim + 1) + 2 * kStateTileRows * value_dim +
                          2 * kChunk + 1);
}

// Grid (max_chunks, Hv). The gradient terms that multiply the chunk's states H and dH:
//   dq_i  = e^gamma_i H do_i                      (w.r.t. scale*q; into dq_acc)
//   dk_j  = e^(gamma_last - gamma_j) dH v_new_j    (into dk_acc)
//   dW_i  = -H dV_new_i                           (overwrites W)
// and the matching d gamma parts (into ws.dgamma). H and dH are staged 32 rows at a time
// (coalesced); each warp owns 4 of those rows and each lane the chunk rows lane and lane + 32.
__global__ void __launch_bounds__(kThreads)
    grads_states_kernel(GatedDeltaRuleShape s, float scale, const __nv_bfloat16* q,
                        const __nv_bfloat16* k, const __nv_bfloat16* d_o, Workspace ws) {
  constexpr int kRowsPerWarp = kStateTileRows / (kThreads / 32);
  const int chunk = blockIdx.x, h = blockIdx.y;
  if (chunk >= *ws.chunk_count) return;
  const ChunkInfo ci = ws.chunks[chunk];
  const int Dk = s.key_dim, Dv = s.value_dim, Hk = s.num_key_heads, Hv = s.num_value_heads;
  const int kh = key_head_of(s, h), len = ci.len, stride = Dv + 1, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  extern __shared__ float smem[];
  float* dos = smem;                         // [64][Dv+1] d_o
  float* vns = dos + kChunk * stride;        // [64][Dv+1] V_new
  float* dvns = vns + kChunk * stride;       // [64][Dv+1] dV_new
  float* h_tile = dvns + kChunk * stride;    // [32][Dv] rows of H
  float* dh_tile = h_tile + kStateTileRows * Dv;  // [32][Dv] rows of dH
  float* s_q = dh_tile + kStateTileRows * Dv;     // [64] (scale q_i) . dq_i
  float* s_k = s_q + kChunk;                 // [64] k_j . dk_j
  float* h_dot_dh = s_k + kChunk;            // [1]
  for (int idx = tid; idx < kChunk * Dv; idx += kThreads) {
    const int i = idx / Dv, e = idx % Dv;
    const bool valid = i < len;
    const int64_t src = (static_cast<int64_t>(ci.t0 + i) * Hv + h) * Dv + e;
    dos[i * stride + e] = valid ? __bfloat162float(d_o[src]) : 0.0f;
    vns[i * stride + e] = valid ? ws.v_new[src] : 0.0f;
    dvns[i * stride + e] = valid ? ws.dv_new[src] : 0.0f;
  }
  for (int i = tid; i < kChunk; i += kThreads) s_q[i] = s_k[i] = 0.0f;
  if (tid == 0) *h_dot_dh = 0.0f;
  const float* state = ws.h + (static_cast<int64_t>(chunk) * Hv + h) * Dk * Dv;
  const float* d_state = ws.dh + (static_cast<int64_t>(chunk) * Hv + h) * Dk * Dv;
  const float g_last = ws.gamma[static_cast<int64_t>(ci.t0 + len - 1) * Hv + h];
  float h_dot_dh_partial = 0.0f;
  for (int d0 = 0; d0 < Dk; d0 += kStateTileRows) {
    __syncthreads();
    for (int idx = tid; idx < kStateTileRows * Dv; idx += kThreads) {
      const int d = d0 + idx / Dv, e = idx % Dv;
      const float hv = d < Dk ? state[d * Dv + e] : 0.0f;
      const float dhv = d < Dk ? d_state[d * Dv + e] : 0.0f;
      h_tile[idx] = hv;
      dh_tile[idx] = dhv;
      h_dot_dh_partial += hv * dhv;
    }
    __syncthreads();
    float h_do[2][kRowsPerWarp] = {}, h_dvn[2][kRowsPerWarp] = {}, dh_vn[2][kRowsPerWarp] = {};
    for (int e = 0; e < Dv; ++e) {
      float x_do[2], x_dvn[2], x_vn[2];
#pragma unroll
      for (int ii = 0; ii < 2; ++ii) {
        const int i = lane + 32 * ii;
        x_do[ii] = dos[i * stride + e];
        x_dvn[ii] = dvns[i * stride + e];
        x_vn[ii] = vns[i * stride + e];
      }
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float hv = h_tile[(warp * kRowsPerWarp + r) * Dv + e];
        const float dhv = dh_tile[(warp * kRowsPerWarp + r) * Dv + e];
#pragma unroll
        for (int ii = 0; ii < 2; ++ii) {
          h_do[ii][r] += hv * x_do[ii];
          h_dvn[ii][r] += hv * x_dvn[ii];
          dh_vn[ii][r] += dhv * x_vn[ii];
        }
      }
    }
#pragma unroll
    for (int ii = 0; ii < 2; ++ii) {
      const int i = lane + 32 * ii;
      if (i >= len) continue;
      const int64_t row = static_cast<int64_t>(ci.t0 + i) * Hv + h;
      const float g_i = ws.gamma[row];
      const float to_end = expf(g_last - g_i), e_i = expf(g_i);
      float q_part = 0.0f, k_part = 0.0f;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const int d = d0 + warp * kRowsPerWarp + r;
        if (d >= Dk) continue;
        const float dq_inter = e_i * h_do[ii][r];
        const float dk_state = to_end * dh_vn[ii][r];
        ws.dq_acc[row * Dk + d] = dq_inter;
        ws.dk_acc[row * Dk + d] = dk_state;
        ws.w[row * Dk + d] = -h_dvn[ii][r];
        const int64_t qk_index = (static_cast<int64_t>(ci.t0 + i) * Hk + kh) * Dk + d;
        q_part += scale * __bfloat162float(q[qk_index]) * dq_inter;
        k_part += __bfloat162float(k[qk_index]) * dk_state;
      }
      atomicAdd(&s_q[i], q_part);
      atomicAdd(&s_k[i], k_part);
    }
  }
  h_dot_dh_partial = warp_sum(h_dot_dh_partial);
  if (lane == 0) atomicAdd(h_dot_dh, h_dot_dh_partial);
  __syncthreads();
  if (tid < len) {
    // d gamma_i += (q_i . dq_i) - (k_i . dk_i); the last token also collects the chunk decay
    // e^gamma_last <H, dH> and every token's e^(gamma_last - gamma_j) k_j^T dH v_new_j.
    float value = s_q[tid] - s_k[tid];
    if (tid == len - 1) {
      value += expf(g_last) * *h_dot_dh;
      for (int j = 0; j < len; ++j) value += s_k[j];
    }
    ws.dgamma[static_cast<int64_t>(ci.t0 + tid) * Hv + h] = value;
  }
}

size_t grads_local_smem_bytes(int key_dim) {
  return sizeof(float) * (2 * kChunk * (key_dim + 1) + 4 * kChunk * kChunk + 7 * kChunk);
}

// Grid (max_chunks, Hv). The chunk-local gradients: the intra-chunk attention term (G = do v_new^T),
// the UT transform (dA, dL = -A^T dA A^T), and the direct k, v, beta, gamma terms; finishes dq,
// dk (per value head, fp32), dv, dbeta, and dg as the reverse cumulative sum of d gamma.
__global__ void __launch_bounds__(kThreads)
    grads_local_kernel(GatedDeltaRuleShape s, float scale, const __nv_bfloat16* q,
                       const __nv_bfloat16* k, const __nv_bfloat16* v, const float* beta,
                       const __nv_bfloat16* d_o, __nv_bfloat16* dv, float* dg, float* dbeta,
                       Workspace ws) {
  const int chunk = blockIdx.x, h = blockIdx.y;
  if (chunk >= *ws.chunk_count) return;
  const ChunkInfo ci = ws.chunks[chunk];
  const int Dk = s.key_dim, Dv = s.value_dim, Hk = s.num_key_heads, Hv = s.num_value_heads;
  const int kh = key_head_of(s, h), len = ci.len, stride = Dk + 1, tid = threadIdx.x;
  extern __shared__ float smem[];
  float* ks = smem;                       // [64][Dk+1]
  float* qs = ks + kChunk * stride;       // [64][Dk+1] scale * q
  float* am = qs + kChunk * stride;       // [64][64] A
  float* ge = am + kChunk * kChunk;       // [64][64] G_ij e^(gamma_i - gamma_j), j <= i
  float* da = ge + kChunk * kChunk;       // [64][64] dA, later C = dL beta_i e^(..)
  float* t1 = da + kChunk * kChunk;       // [64][64] dA A^T
  float* gam = t1 + kChunk * kChunk;      // [64]
  float* bet = gam + kChunk;              // [64]
  float* e_gam = bet + kChunk;            // [64]
  float* d_gam = e_gam + kChunk;          // [64]
  float* d_bet = d_gam + kChunk;          // [64]
  float* dx_dot_k = d_bet + kChunk;       // [64]
  float* dy_dot_v = dx_dot_k + kChunk;    // [64]
  auto row_of = [&](int i) { return static_cast<int64_t>(ci.t0 + i) * Hv + h; };

  for (int idx = tid; idx < len * Dk; idx += kThreads) {
    const int i = idx / Dk, d = idx % Dk;
    const int64_t src = (static_cast<int64_t>(ci.t0 + i) * Hk + kh) * Dk + d;
    ks[i * stride + d] = __bfloat162float(k[src]);
    qs[i * stride + d] = scale * __bfloat162float(q[src]);
  }
  const float* a_in = ws.a_inv + (static_cast<int64_t>(chunk) * Hv + h) * kChunk * kChunk;
  for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) am[idx] = a_in[idx];
  for (int i = tid; i < kChunk; i += kThreads) {
    const bool valid = i < len;
    gam[i] = valid ? ws.gamma[row_of(i)] : 0.0f;
    bet[i] = valid ? beta[row_of(i)] : 0.0f;
    e_gam[i] = expf(gam[i]);
    d_gam[i] = valid ? ws.dgamma[row_of(i)] : 0.0f;
    d_bet[i] = dx_dot_k[i] = dy_dot_v[i] = 0.0f;
  }
  __syncthreads();

  // G_ij = do_i . v_new_j (j <= i): intra-chunk output term; M_ij = G_ij P_ij moves gamma.
  // dA_ij = beta_j e^gamma_j (dW_i . k_j) + beta_j (dV_new_i . v_j) on the strict lower part.
  // One warp per (i, j): its lanes stride the head dim, so the row reads are coalesced.
  const float* p_in = ws.p + (static_cast<int64_t>(chunk) * Hv + h) * kChunk * kChunk;
  const int warp = tid / 32, lane = tid % 32;
  for (int pair = warp; pair < kChunk * kChunk; pair += kThreads / 32) {
    const int i = pair / kChunk, j = pair % kChunk;
    float ge_value = 0.0f, da_value = 0.0f;
    if (i < len && j <= i) {
      const __nv_bfloat16* do_i = d_o + row_of(i) * Dv;
      const float* vn_j = ws.v_new + row_of(j) * Dv;
      float g_ij = 0.0f;
      for (int e = lane; e < Dv; e += 32) g_ij += __bfloat162float(do_i[e]) * vn_j[e];
      g_ij = warp_sum(g_ij);
      ge_value = g_ij * expf(gam[i] - gam[j]);
      if (j < i) {
        const float* dw_i = ws.w + row_of(i) * Dk;
        const float* dvn_i = ws.dv_new + row_of(i) * Dv;
        const __nv_bfloat16* v_j = v + row_of(j) * Dv;
        float dw_k = 0.0f, dvn_v = 0.0f;
        for (int d = lane; d < Dk; d += 32) dw_k += dw_i[d] * ks[j * stride + d];
        for (int e = lane; e < Dv; e += 32) dvn_v += dvn_i[e] * __bfloat162float(v_j[e]);
        dw_k = warp_sum(dw_k);
        dvn_v = warp_sum(dvn_v);
        da_value = bet[j] * e_gam[j] * dw_k + bet[j] * dvn_v;
        if (lane == 0) {
          const float m_ij = g_ij * p_in[pair];
          atomicAdd(&d_gam[i], m_ij);
          atomicAdd(&d_gam[j], -m_ij);
        }
      }
    }
    if (lane == 0) {
      ge[pair] = ge_value;
      da[pair] = da_value;
    }
  }
  __syncthreads();
  // t1 = dA A^T: t1[a][j] = sum_{b <= j} dA[a][b] A[j][b].
  for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) {
    const int a = idx / kChunk, j = idx % kChunk;
    float sum = 0.0f;
    if (a < len && j < len) {
      for (int b = 0; b <= j && b < a; ++b) sum += da[a * kChunk + b] * am[j * kChunk + b];
    }
    t1[idx] = sum;
  }
  __syncthreads();
  // dL = -A^T t1 on the strict lower part; L_ij = beta_i (k_i . k_j) e^(gamma_i - gamma_j).
  // da is free now and receives C_ij = dL_ij beta_i e^(gamma_i - gamma_j) (dk gets (C + C^T) K).
  for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) {
    const int i = idx / kChunk, j = idx % kChunk;
    float c_value = 0.0f;
    if (i < len && j < i) {
      float sum = 0.0f;
      for (int a = i; a < len; ++a) sum += am[a * kChunk + i] * t1[a * kChunk + j];
      const float dl = -sum;
      float kk = 0.0f;
      for (int d = 0; d < Dk; ++d) kk += ks[i * stride + d] * ks[j * stride + d];
      const float decay = expf(gam[i] - gam[j]);
      const float f = dl * kk * decay;
      atomicAdd(&d_bet[i], f);
      atomicAdd(&d_gam[i], bet[i] * f);
      atomicAdd(&d_gam[j], -bet[i] * f);
      c_value = dl * bet[i] * decay;
    }
    da[idx] = c_value;
  }
  __syncthreads();
  const float* cm = da;
  // dq and dk rows. dX = A^T dW gives k's direct term beta e^gamma dX.
  for (int idx = tid; idx < len * Dk; idx += kThreads) {
    const int i = idx / Dk, d = idx % Dk;
    const int64_t at = row_of(i) * Dk + d;
    float dq_value = ws.dq_acc[at];
    for (int j = 0; j <= i; ++j) dq_value += ge[i * kChunk + j] * ks[j * stride + d];
    ws.dq_acc[at] = scale * dq_value;
    float dx = 0.0f;
    for (int a = i; a < len; ++a) dx += am[a * kChunk + i] * ws.w[row_of(a) * Dk + d];
    float dk_value = ws.dk_acc[at] + bet[i] * e_gam[i] * dx;
    for (int a = i; a < len; ++a) dk_value += ge[a * kChunk + i] * qs[a * stride + d];
    for (int j = 0; j < i; ++j) dk_value += cm[i * kChunk + j] * ks[j * stride + d];
    for (int a = i + 1; a < len; ++a) dk_value += cm[a * kChunk + i] * ks[a * stride + d];
    ws.dk_acc[at] = dk_value;
    atomicAdd(&dx_dot_k[i], dx * ks[i * stride + d]);
  }
  // dv = beta dY with dY = A^T dV_new (dU = dV_new).
  for (int idx = tid; idx < len * Dv; idx += kThreads) {
    const int i = idx / Dv, e = idx % Dv;
    float dy = 0.0f;
    for (int a = i; a < len; ++a) dy += am[a * kChunk + i] * ws.dv_new[row_of(a) * Dv + e];
    dv[row_of(i) * Dv + e] = __float2bfloat16(bet[i] * dy);
    atomicAdd(&dy_dot_v[i], dy * __bfloat162float(v[row_of(i) * Dv + e]));
  }
  __syncthreads();
  if (tid == 0) {
    // gamma is the chunk-local prefix sum of g, so dg is the reverse cumulative sum of d gamma.
    float suffix = 0.0f;
    for (int i = len - 1; i >= 0; --i) {
      const float direct = bet[i] * e_gam[i] * dx_dot_k[i];
      suffix += d_gam[i] + direct;
      dg[row_of(i)] = suffix;
      dbeta[row_of(i)] = d_bet[i] + e_gam[i] * dx_dot_k[i] + dy_dot_v[i];
    }
  }
}

// dq, dk [T, Hk, Dk] bf16 = sum over the value heads that share each key head.
__global__ void reduce_key_grads_kernel(GatedDeltaRuleShape s, Workspace ws, __nv_bfloat16* dq,
                                        __nv_bfloat16* dk) {
  const int Dk = s.key_dim, Hk = s.num_key_heads, Hv = s.num_value_heads;
  const int group = Hv / Hk;
  const int64_t count = s.num_tokens * Hk * Dk;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; idx < count;
       idx += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t t = idx / (static_cast<int64_t>(Hk) * Dk);
    const int kh = static_cast<int>((idx / Dk) % Hk), d = static_cast<int>(idx % Dk);
    float sum_q = 0.0f, sum_k = 0.0f;
    for (int h = kh * group; h < (kh + 1) * group; ++h) {
      const int64_t at = (t * Hv + h) * Dk + d;
      sum_q += ws.dq_acc[at];
      sum_k += ws.dk_acc[at];
    }
    dq[idx] = __float2bfloat16(sum_q);
    dk[idx] = __float2bfloat16(sum_k);
  }
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  int device = 0, limit = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  CHECK(bytes <= static_cast<size_t>(limit), "gated_delta_rule_backward_cuda: needs ", bytes,
        " bytes of shared memory per block, the device allows ", limit);
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)));
}

}  // namespace
}  // namespace gdn_cuda

size_t gated_delta_rule_backward_workspace_bytes(const GatedDeltaRuleShape& shape) {
  return gdn_cuda::carve_workspace(shape, true, nullptr, nullptr);
}

void gated_delta_rule_backward_cuda(const GatedDeltaRuleShape& shape, float scale,
                                    const __nv_bfloat16* q, const __nv_bfloat16* k,
                                    const __nv_bfloat16* v, const float* g, const float* beta,
                                    const float* initial_state, const __nv_bfloat16* d_o,
                                    const float* d_final_state, __nv_bfloat16* dq,
                                    __nv_bfloat16* dk, __nv_bfloat16* dv, float* dg, float* dbeta,
                                    float* d_initial_state, void* workspace,
                                    size_t workspace_bytes, cudaStream_t stream) {
  using namespace gdn_cuda;
  check_shape("gated_delta_rule_backward_cuda", shape);
  const size_t needed = gated_delta_rule_backward_workspace_bytes(shape);
  CHECK(workspace != nullptr && workspace_bytes >= needed,
        "gated_delta_rule_backward_cuda: workspace of ", workspace_bytes, " bytes, need ", needed);
  Workspace ws{};
  carve_workspace(shape, true, workspace, &ws);
  const bool has_tokens = shape.num_tokens > 0;
  // Recompute the forward chunk quantities, the chunk-entry states H and V_new.
  launch_build_chunk_table(shape, ws, stream);
  if (has_tokens) launch_prepare_chunks(shape, scale, q, k, v, g, beta, ws, stream);
  launch_state_scan(shape, k, initial_state, nullptr, ws, stream);
  // Reverse scan: dH per chunk, dV_new, and d_initial_state (= d_final_state without tokens).
  const dim3 scan_grid(shape.num_seqs, shape.num_value_heads,
                       (shape.value_dim + kScanColumns - 1) / kScanColumns);
  dstate_scan_kernel<<<scan_grid, kThreads, 0, stream>>>(shape, scale, q, k, d_o, d_final_state,
                                                         d_initial_state, ws);
  CUDA_CHECK_LAUNCH();
  if (!has_tokens) return;
  const dim3 chunk_grid(static_cast<unsigned>(max_chunks(shape)), shape.num_value_heads);
  const size_t states_smem = grads_states_smem_bytes(shape.value_dim);
  allow_smem(grads_states_kernel, states_smem);
  grads_states_kernel<<<chunk_grid, kThreads, states_smem, stream>>>(shape, scale, q, k, d_o, ws);
  CUDA_CHECK_LAUNCH();
  const size_t local_smem = grads_local_smem_bytes(shape.key_dim);
  allow_smem(grads_local_kernel, local_smem);
  grads_local_kernel<<<chunk_grid, kThreads, local_smem, stream>>>(shape, scale, q, k, v, beta,
                                                                   d_o, dv, dg, dbeta, ws);
  CUDA_CHECK_LAUNCH();
  const int64_t count = shape.num_tokens * shape.num_key_heads * shape.key_dim;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(4096, (count + kThreads - 1) / kThreads));
  reduce_key_grads_kernel<<<blocks, kThreads, 0, stream>>>(shape, ws, dq, dk);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
