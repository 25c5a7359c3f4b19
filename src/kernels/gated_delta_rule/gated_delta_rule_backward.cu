// CUDA backward of the chunked gated delta rule, following chunk_backward in the chunked CPU
// reference: recompute the forward chunk quantities and states, a reverse scan over chunks for
// dL/dH and dV_new, then chunk-local gradients; products on tensor cores (gdn_mma.cuh) with bf16
// operands and fp32 accumulators, the running dL/dH, gates and reductions in fp32.
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/common/kernel_path_cuda.h"
#include "kernels/gated_delta_rule/gated_delta_rule_cuda.h"
#include "kernels/gated_delta_rule/gated_delta_rule_internal.cuh"
#include "kernels/gated_delta_rule/gdn_mma.cuh"

namespace deltamoe {
namespace gdn_cuda {
namespace {

// State columns one reverse-scan block carries. Like the forward scan, a chain of dependent steps
// bound by latency: 32 columns (4 blocks per head, ~86 KB of shared tiles) let two blocks share an
// SM with half the step each, against one block of 64 columns.
constexpr int kDScanCols = 32;

// Shared tiles of the reverse state scan carrying kCols state columns per block (fits sm_80's
// 163 KB, so one variant serves both). The running dL/dH stays fp32 in registers (the dH update's
// accumulators); its bf16 copy here is the operand of dV_new and the stored slot.
template <int kCols>
struct DScanSmem {
  static constexpr int kBf16ColStride = kCols + 8;  // bf16 rows: 16-byte aligned for the copies
  alignas(16) __nv_bfloat16 dhb[kD * kBf16ColStride];  // columns [col0, col0 + kCols) of dL/dH, bf16
  alignas(16) __nv_bfloat16 w[kChunk * kBf16Stride];   // W of the chunk (read transposed)
  alignas(16) __nv_bfloat16 q[kChunk * kBf16Stride];
  alignas(16) __nv_bfloat16 k[kChunk * kBf16Stride];
  alignas(16) __nv_bfloat16 p[kChunk * kSqBf16Stride];  // P (read transposed)
  alignas(16) __nv_bfloat16 d_o[kChunk * kBf16ColStride];
  alignas(16) __nv_bfloat16 d_o_scaled[kChunk * kBf16ColStride];  // scale e^gamma_i do_i
  alignas(16) __nv_bfloat16 dvn[kChunk * kBf16ColStride];
  alignas(16) float gamma[kChunk];
};

static_assert(2 * sizeof(DScanSmem<kDScanCols>) <= 227 * 1024 && sizeof(DScanSmem<kDScanCols>) <= kSm80MaxSharedBytesPerBlock,
              "the reverse scan's shared tiles must fit sm_80's 163 KB per block, and two blocks an H200 SM");

// Grid (N, Hv, ceil(Dv / kCols)). Reverse scan over the chunks of one sequence carrying kCols
// columns of dL/dH. Per chunk (last first): stores dH leaving the chunk (when it has a slot: all
// but the sequence's last chunk, whose dH is d_final_state), then
//   dV_new_j = sum_{i>=j} P_ij do_i + e^(gamma_last - gamma_j) dH^T k_j,
//   dH <- e^gamma_last dH + sum_i e^gamma_i (scale q_i) do_i^T - W^T dV_new.
template <int kCols>
__global__ void __launch_bounds__(kThreads, 2)
    dstate_scan_kernel(GatedDeltaRuleShape s, float scale, const __nv_bfloat16* q,
                       const __nv_bfloat16* k, const __nv_bfloat16* d_o,
                       const float* d_final_state, float* d_initial_state, Workspace ws) {
  constexpr int kBf16ColStride = DScanSmem<kCols>::kBf16ColStride;
  static_assert(kCols % 8 == 0, "rows of the scaled d_o and of dV_new move in 16-byte pieces");
  const int n = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * kCols;
  const int Dk = s.key_dim, Dv = s.value_dim, Hk = s.num_key_heads, Hv = s.num_value_heads;
  const int kh = key_head_of(s, h), tid = threadIdx.x, warp = tid >> 5;
  const int cols = min(kCols, Dv - col0);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  DScanSmem<kCols>& sm = *reinterpret_cast<DScanSmem<kCols>*>(smem_raw);
  const int64_t state_base = (static_cast<int64_t>(n) * Hv + h) * Dk * Dv + col0;
  // dL/dH: the dH update's accumulator tile of this warp, rows 16 warp, all kCols columns.
  constexpr int kStateNT = kCols / 8;
  const int state_m0 = 16 * warp;
  RunningState<kCols> dstate;
  load_running_state<kCols>(dstate, d_final_state == nullptr ? nullptr : d_final_state + state_base, s, cols, sm.dhb,
                            kBf16ColStride);
  // The chunks' places come from cu_seqlens (sequence_chunk), not from the table: no step waits
  // on a table read before it can address its inputs.
  const int begin = s.cu_seqlens[n], end = s.cu_seqlens[n + 1], slot0 = ws.slot_offsets[n];
  const int chunks = (end - begin + kChunk - 1) / kChunk;
  // A chunk's inputs come in two groups of copies that overlap the other half of the work: K, P,
  // d_o and gamma (the dV_new half) fly during the previous chunk's dH half, W and Q (the dH half)
  // during this chunk's dV_new half. No extra shared memory.
  auto issue_dvn_inputs = [&](int c) {
    const ChunkInfo ci = sequence_chunk(begin, end, n, slot0, c);
    const int64_t row_first = static_cast<int64_t>(ci.t0) * Hv + h;
    load_tile(sm.k, kBf16Stride, kChunk, kD, k + (static_cast<int64_t>(ci.t0) * Hk + kh) * Dk,
              static_cast<int64_t>(Hk) * Dk, ci.len, Dk);
    load_tile(sm.p, kSqBf16Stride, kChunk, kChunk, ws.p + row_first * kChunk,
              static_cast<int64_t>(Hv) * kChunk, ci.len, kChunk);
    load_tile(sm.d_o, kBf16ColStride, kChunk, kCols, d_o + row_first * Dv + col0,
              static_cast<int64_t>(Hv) * Dv, ci.len, cols);
    for (int i = tid; i < kChunk; i += kThreads) {
      const bool valid = i < ci.len;
      cp_async_4(&sm.gamma[i], ws.gamma + (valid ? row_first + static_cast<int64_t>(i) * Hv : 0),
                 valid);
    }
    cp_async_commit();
  };
  auto issue_dh_inputs = [&](int c) {
    const ChunkInfo ci = sequence_chunk(begin, end, n, slot0, c);
    const int64_t row_first = static_cast<int64_t>(ci.t0) * Hv + h;
    load_tile(sm.w, kBf16Stride, kChunk, kD, ws.w + row_first * Dk, static_cast<int64_t>(Hv) * Dk,
              ci.len, Dk);
    load_tile(sm.q, kBf16Stride, kChunk, kD, q + (static_cast<int64_t>(ci.t0) * Hk + kh) * Dk,
              static_cast<int64_t>(Hk) * Dk, ci.len, Dk);
    cp_async_commit();
  };
  // dV_new leaves in 16-byte row pieces from its shared tile; a value dim that is not a multiple
  // of 8 stores it element by element.
  const bool staged = Dv % 8 == 0;
  if (chunks > 0) issue_dvn_inputs(chunks - 1);
  for (int c = chunks - 1; c >= 0; --c) {
    const ChunkInfo ci = sequence_chunk(begin, end, n, slot0, c);
    const int len = ci.len;
    const int64_t row_first = static_cast<int64_t>(ci.t0) * Hv + h;
    cp_async_wait<0>();  // the dV_new inputs of chunk c
    __syncthreads();     // ... for everybody; the previous dH half is done with W, Q, dH, dV_new
    issue_dh_inputs(c);
    if (ci.dh_slot >= 0)
      store_state_slice<kCols>(ws.dh + (static_cast<int64_t>(ci.dh_slot) * Hv + h) * Dk * Dv + col0, sm.dhb,
                               kBf16ColStride, s, cols);
    const float g_last = sm.gamma[len - 1];
    // Eight columns of one row a thread: one exponential and one 16-byte load and store each.
    for (int idx = tid; idx < kChunk * (kCols / 8); idx += kThreads) {
      const int i = idx / (kCols / 8), e0 = 8 * (idx % (kCols / 8));
      const float factor = scale * expf(sm.gamma[i]);
      uint4 piece = *reinterpret_cast<const uint4*>(&sm.d_o[i * kBf16ColStride + e0]);
      auto* pairs = reinterpret_cast<__nv_bfloat162*>(&piece);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float2 x = __bfloat1622float2(pairs[u]);
        pairs[u] = __floats2bfloat162_rn(factor * x.x, factor * x.y);
      }
      *reinterpret_cast<uint4*>(&sm.d_o_scaled[i * kBf16ColStride + e0]) = piece;
    }
    {
      // dV_new: 64 x kCols, warp tile rows 16 (warp % 4), columns kCols / 2 (warp / 4).
      constexpr int NT = kCols / 16;
      const int m0 = 16 * (warp & 3), n0 = (kCols / 2) * (warp >> 2);
      float acc[1][NT][4];
      zero_acc(acc);
      warp_mma<1, NT, kD, kD / 16>(acc, rows_of<kBf16Stride>(sm.k), m0, rows_of<kBf16ColStride>(sm.dhb), n0);
      // A lane's accumulators lie on two rows, j and j + 8: one decay each.
      const int j0 = m0 + ((tid & 31) >> 2);
      const float row_decay[2] = {j0 < len ? expf(g_last - sm.gamma[j0]) : 0.0f,
                                  j0 + 8 < len ? expf(g_last - sm.gamma[j0 + 8]) : 0.0f};
      for_each_acc<1, NT>(m0, n0, [&](int mt, int nt, int r, int, int) { acc[mt][nt][r] *= row_decay[r >> 1]; });
      warp_mma<1, NT, kChunk, kChunk / 16>(acc, transposed<kSqBf16Stride>(sm.p), m0, rows_of<kBf16ColStride>(sm.d_o), n0);
      for_each_acc<1, NT>(m0, n0, [&](int mt, int nt, int r, int j, int e) {
        const __nv_bfloat16 value = __float2bfloat16(acc[mt][nt][r]);
        if (!staged && j < len && e < cols) ws.dv_new[(row_first + static_cast<int64_t>(j) * Hv) * Dv + col0 + e] = value;
        sm.dvn[j * kBf16ColStride + e] = value;
      });
    }
    __syncthreads();  // K, P, d_o, gamma are free; dV_new and the scaled d_o are complete
    // dV_new leaves from its shared tile in 16-byte row pieces (the dH half only reads the tile).
    if (staged)
      copy_tile_rows<kCols, kBf16ColStride, kThreads>(ws.dv_new + row_first * Dv + col0, static_cast<int64_t>(Hv) * Dv,
                                                      sm.dvn, len, cols);
    if (c > 0) {
      issue_dvn_inputs(c - 1);
      cp_async_wait<1>();  // W and Q of chunk c (the newer group may still fly)
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    {
      // dH, in this warp's registers; then its bf16 copy.
      const float chunk_decay = expf(g_last);
      float acc[1][kStateNT][4], minus[1][kStateNT][4];
      for_each_acc<1, kStateNT>(state_m0, 0, [&](int mt, int nt, int r, int, int) {
        acc[mt][nt][r] = chunk_decay * dstate[mt][nt][r];
      });
      warp_mma<1, kStateNT, kChunk, kChunk / 16>(acc, transposed<kBf16Stride>(sm.q), state_m0,
                                    rows_of<kBf16ColStride>(sm.d_o_scaled), 0);
      zero_acc(minus);
      warp_mma<1, kStateNT, kChunk, kChunk / 16>(minus, transposed<kBf16Stride>(sm.w), state_m0,
                                    rows_of<kBf16ColStride>(sm.dvn), 0);
      for_each_acc<1, kStateNT>(state_m0, 0, [&](int mt, int nt, int r, int d, int e) {
        const float value = acc[mt][nt][r] - minus[mt][nt][r];
        dstate[mt][nt][r] = value;
        sm.dhb[d * kBf16ColStride + e] = __float2bfloat16(value);
      });
    }
  }
  if (d_initial_state != nullptr) store_running_state<kCols>(dstate, d_initial_state + state_base, s, cols);
}

// Runs f(0), ..., f(kParts - 1): the pieces of a 64 x 128 product's warp tile (its 8 column tiles,
// 8 / kParts a piece). The fp32 key-head sums a lane adds its terms to are read for a piece, all
// loads in flight at once, before any is written; smaller pieces hold fewer registers.
template <int kParts, typename F>
__device__ __forceinline__ void for_each_tile_part(F&& f) {
#pragma unroll
  for (int piece = 0; piece < kParts; ++piece) f(piece);
}

// Shared tiles of the state-gradient kernel (~70 KB: two blocks per SM, so that one block's
// copies overlap the other's products). x holds d_o and q, then dV_new, then V_new.
struct StatesSmem {
  alignas(16) __nv_bfloat16 h[kD * kBf16Stride];      // H, then dH (rows d, read transposed as B)
  alignas(16) __nv_bfloat16 x[2 * kChunk * kBf16Stride];
  alignas(16) float gamma[kChunk];
  float s_q[kChunk], s_k[kChunk];
  float h_dot_dh[kThreads / 32];  // per warp, summed in warp order (deterministic)
};
static_assert(sizeof(StatesSmem) <= kSm80MaxSharedBytesPerBlock, "the shared tiles must fit sm_80's 163 KB");

// Value head h of chunk ci: the gradient terms that multiply the chunk's states H and dH,
//   dq_i = e^gamma_i H do_i                     (w.r.t. scale*q; into dq_acc)
//   dk_j = e^(gamma_last - gamma_j) dH v_new_j  (into dk_acc)
//   dW_i = -H dV_new_i                          (its own array: W stays the forward's)
// and the matching d gamma parts (into ws.dgamma). H and dH are the chunk's slots or, at the
// ends of its sequence, the initial state and d_final_state (null: zeros). dq_acc and dk_acc are
// per key head: the first value head of the key head's group writes them and the others add (a
// thread owns the same elements for every head, so no barrier is needed between the heads' writes).
__device__ __forceinline__ void grads_states_head(const GatedDeltaRuleShape& s, float scale, const __nv_bfloat16* q,
                                                  const __nv_bfloat16* k, const __nv_bfloat16* d_o,
                                                  const float* initial_state, const float* d_final_state,
                                                  const Workspace& ws, const ChunkInfo& ci, int h, bool first_head) {
  const int Dk = s.key_dim, Dv = s.value_dim, Hk = s.num_key_heads, Hv = s.num_value_heads;
  const int kh = key_head_of(s, h), len = ci.len, tid = threadIdx.x, warp = tid >> 5;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  StatesSmem& sm = *reinterpret_cast<StatesSmem*>(smem_raw);
  const int64_t row_first = static_cast<int64_t>(ci.t0) * Hv + h;
  const int64_t key_row_first = static_cast<int64_t>(ci.t0) * Hk + kh;  // rows of q, k, dq_acc, dk_acc
  const int64_t qk_first = key_row_first * Dk;
  // The key-head sums, dW and k are touched two adjacent elements (d, d + 1) at a time: as one
  // 8-byte (fp32) or 4-byte (bf16) access when Dk is even (the workspace arrays start on 256 bytes;
  // k, the caller's, must also sit on 4 bytes), else one by one.
  const bool pairs = Dk % 2 == 0, k_pairs = pairs && (reinterpret_cast<uintptr_t>(k) & 3) == 0;
  // A lane's key-head sums are all read before any is written (see for_each_tile_part): a
  // store may alias a later load, so reading and writing them pair by pair made each pair wait a
  // full L2 round trip. The first value head of the group reads nothing: it writes its terms.
  auto read_key_sums = [&](const float* acc_array, int i, int d) {
    if (first_head || i >= len || d >= Dk) return make_float2(0.0f, 0.0f);
    const float* slot = acc_array + (key_row_first + static_cast<int64_t>(i) * Hk) * Dk + d;
    if (pairs) return *reinterpret_cast<const float2*>(slot);
    return make_float2(slot[0], d + 1 < Dk ? slot[1] : 0.0f);
  };
  auto write_key_terms = [&](float* acc_array, int i, int d, float2 sum, float v0, float v1) {
    float* slot = acc_array + (key_row_first + static_cast<int64_t>(i) * Hk) * Dk + d;
    const float2 total = first_head ? make_float2(v0, v1) : make_float2(sum.x + v0, sum.y + v1);
    if (pairs) {
      *reinterpret_cast<float2*>(slot) = total;
      return;
    }
    slot[0] = total.x;
    if (d + 1 < Dk) slot[1] = total.y;
  };
  __nv_bfloat16* d_o_tile = sm.x;
  __nv_bfloat16* q_tile = sm.x + kChunk * kBf16Stride;
  load_state_tile(sm.h, kBf16Stride, kD, entering_state(s, ws, ci, initial_state, h), s, 0, Dv);
  load_tile(d_o_tile, kBf16Stride, kChunk, kD, d_o + row_first * Dv, static_cast<int64_t>(Hv) * Dv,
            len, Dv);
  load_tile(q_tile, kBf16Stride, kChunk, kD, q + qk_first, static_cast<int64_t>(Hk) * Dk, len, Dk);
  if (tid < kChunk) {
    sm.gamma[tid] = tid < len ? ws.gamma[row_first + static_cast<int64_t>(tid) * Hv] : 0.0f;
    sm.s_q[tid] = sm.s_k[tid] = 0.0f;
  }
  wait_tile_loads();
  __syncthreads();
  const float g_last = sm.gamma[len - 1];
  const int m0 = 16 * (warp & 3), n0 = 64 * (warp >> 2);  // 64 x 128 outputs
  // The warp tile's column tiles in pieces whose sums are read together (for_each_tile_part):
  // fewer pieces, fewer round trips; more, fewer registers held.
  constexpr int kDqParts = 4, kDkParts = 4;
  float acc[1][8][4], part[1][8][4];
  // dq_i = e^gamma_i sum_e do_ie H_de.
  zero_acc(acc);
  warp_mma<1, 8, kD>(acc, rows_of<kBf16Stride>(d_o_tile), m0, transposed<kBf16Stride>(sm.h), n0);
  for_each_tile_part<kDqParts>([&](int piece) {
    float2 sums[8 / kDqParts][2];
    for_each_acc_pair<1, 8>(m0, n0, [&](int, int nt, int half, int i, int d) {
      if (nt / (8 / kDqParts) == piece) sums[nt % (8 / kDqParts)][half] = read_key_sums(ws.dq_acc, i, d);
    });
    for_each_acc_pair<1, 8>(m0, n0, [&](int mt, int nt, int half, int i, int d) {
      if (nt / (8 / kDqParts) != piece) return;
      const float decay = expf(sm.gamma[i]);
      const float v0 = decay * acc[mt][nt][2 * half], v1 = decay * acc[mt][nt][2 * half + 1];
      part[mt][nt][2 * half] = part[mt][nt][2 * half + 1] = 0.0f;
      if (i < len && d < Dk) {
        write_key_terms(ws.dq_acc, i, d, sums[nt % (8 / kDqParts)][half], v0, v1);
        part[mt][nt][2 * half] = scale * __bfloat162float(q_tile[i * kBf16Stride + d]) * v0;
        if (d + 1 < Dk) part[mt][nt][2 * half + 1] = scale * __bfloat162float(q_tile[i * kBf16Stride + d + 1]) * v1;
      }
    });
  });
  add_row_sums(part, m0, sm.s_q);
  __syncthreads();  // d_o and q are done: dV_new takes their place
  load_tile(sm.x, kBf16Stride, kChunk, kD, ws.dv_new + row_first * Dv, static_cast<int64_t>(Hv) * Dv,
            len, Dv);
  wait_tile_loads();
  __syncthreads();
  // dW_i = -sum_e dV_new_ie H_de.
  zero_acc(acc);
  warp_mma<1, 8, kD>(acc, rows_of<kBf16Stride>(sm.x), m0, transposed<kBf16Stride>(sm.h), n0);
  for_each_acc_pair<1, 8>(m0, n0, [&](int mt, int nt, int half, int i, int d) {
    if (i >= len || d >= Dk) return;
    __nv_bfloat16* out = ws.dw + (row_first + static_cast<int64_t>(i) * Hv) * Dk + d;
    if (pairs) {
      *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(-acc[mt][nt][2 * half], -acc[mt][nt][2 * half + 1]);
    } else {
      out[0] = __float2bfloat16(-acc[mt][nt][2 * half]);
      if (d + 1 < Dk) out[1] = __float2bfloat16(-acc[mt][nt][2 * half + 1]);
    }
  });
  __syncthreads();
  // dH replaces H in place; each thread multiplies the H values it overwrites into <H, dH>.
  // Fixed trip counts with all of a thread's loads issued first (one memory round trip).
  {
    const StateSource dh_in = leaving_state_grad(s, ws, ci, d_final_state, h);  // neither: zeros
    float partial = 0.0f;
    if (dh_in.caller == nullptr && Dv % 8 == 0) {
      // A slot (or zeros): 8 bf16 (16 bytes) at a time; its rows (Dv elements) keep that alignment.
      constexpr int kPerThread = kD * kD / 8 / kThreads;
      uint4 values[kPerThread];
#pragma unroll
      for (int u = 0; u < kPerThread; ++u) {
        const int idx = tid + u * kThreads, d = idx / (kD / 8), e = 8 * (idx % (kD / 8));
        values[u] = dh_in.slot != nullptr && d < Dk && e < Dv
                        ? *reinterpret_cast<const uint4*>(dh_in.slot + static_cast<int64_t>(d) * Dv + e)
                        : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int u = 0; u < kPerThread; ++u) {
        const int idx = tid + u * kThreads, d = idx / (kD / 8), e = 8 * (idx % (kD / 8));
        uint4* at = reinterpret_cast<uint4*>(sm.h + d * kBf16Stride + e);
        const uint4 old = *at;
        const auto* h_pairs = reinterpret_cast<const __nv_bfloat162*>(&old);
        const auto* dh_pairs = reinterpret_cast<const __nv_bfloat162*>(&values[u]);
#pragma unroll
        for (int pair = 0; pair < 4; ++pair) {
          const float2 hv = __bfloat1622float2(h_pairs[pair]), dv2 = __bfloat1622float2(dh_pairs[pair]);
          partial += hv.x * dv2.x + hv.y * dv2.y;
        }
        *at = values[u];
      }
    } else {
      for (int idx = tid; idx < kD * kD; idx += kThreads) {
        const int d = idx / kD, e = idx % kD;
        float dh_value = 0.0f;
        if (d < Dk && e < Dv) {
          const int64_t at = static_cast<int64_t>(d) * Dv + e;
          if (dh_in.slot != nullptr) dh_value = __bfloat162float(dh_in.slot[at]);
          else if (dh_in.caller != nullptr) dh_value = dh_in.caller[at];
        }
        partial += __bfloat162float(sm.h[d * kBf16Stride + e]) * dh_value;
        sm.h[d * kBf16Stride + e] = __float2bfloat16(dh_value);
      }
    }
    partial = warp_sum(partial);
    if ((tid & 31) == 0) sm.h_dot_dh[warp] = partial;
  }
  load_tile(sm.x, kBf16Stride, kChunk, kD, ws.v_new + row_first * Dv, static_cast<int64_t>(Hv) * Dv,
            len, Dv);
  wait_tile_loads();
  __syncthreads();
  // dk_j = e^(gamma_last - gamma_j) sum_e v_new_je dH_de. k has no shared tile here (two blocks
  // per SM leave no room): its values come from global memory (L2).
  zero_acc(acc);
  warp_mma<1, 8, kD>(acc, rows_of<kBf16Stride>(sm.x), m0, transposed<kBf16Stride>(sm.h), n0);
  for_each_tile_part<kDkParts>([&](int piece) {
    // k's values come with the sums, before the first write, for the same reason.
    float2 sums[8 / kDkParts][2];
    __nv_bfloat162 k_values[8 / kDkParts][2];  // kept in bf16: one register a pair
    for_each_acc_pair<1, 8>(m0, n0, [&](int, int nt, int half, int j, int d) {
      if (nt / (8 / kDkParts) != piece) return;
      sums[nt % (8 / kDkParts)][half] = read_key_sums(ws.dk_acc, j, d);
      __nv_bfloat162 k_pair = __floats2bfloat162_rn(0.0f, 0.0f);
      if (j < len && d < Dk) {
        const __nv_bfloat16* k_row = k + qk_first + static_cast<int64_t>(j) * Hk * Dk + d;
        if (k_pairs) k_pair = *reinterpret_cast<const __nv_bfloat162*>(k_row);
        else k_pair = __halves2bfloat162(k_row[0], d + 1 < Dk ? k_row[1] : __float2bfloat16(0.0f));
      }
      k_values[nt % (8 / kDkParts)][half] = k_pair;
    });
    for_each_acc_pair<1, 8>(m0, n0, [&](int mt, int nt, int half, int j, int d) {
      if (nt / (8 / kDkParts) != piece) return;
      part[mt][nt][2 * half] = part[mt][nt][2 * half + 1] = 0.0f;
      if (j < len && d < Dk) {
        const float decay = expf(g_last - sm.gamma[j]);
        const float v0 = decay * acc[mt][nt][2 * half], v1 = decay * acc[mt][nt][2 * half + 1];
        write_key_terms(ws.dk_acc, j, d, sums[nt % (8 / kDkParts)][half], v0, v1);
        const float2 k_pair = __bfloat1622float2(k_values[nt % (8 / kDkParts)][half]);
        part[mt][nt][2 * half] = k_pair.x * v0;
        if (d + 1 < Dk) part[mt][nt][2 * half + 1] = k_pair.y * v1;
      }
    });
  });
  add_row_sums(part, m0, sm.s_k);
  __syncthreads();
  if (tid < len) {
    // d gamma_i += (q_i . dq_i) - (k_i . dk_i); the last token also collects the chunk decay
    // e^gamma_last <H, dH> and every token's e^(gamma_last - gamma_j) k_j^T dH v_new_j.
    float value = sm.s_q[tid] - sm.s_k[tid];
    if (tid == len - 1) {
      float h_dot_dh = 0.0f;
      for (int w = 0; w < kThreads / 32; ++w) h_dot_dh += sm.h_dot_dh[w];
      value += expf(g_last) * h_dot_dh;
      for (int j = 0; j < len; ++j) value += sm.s_k[j];
    }
    ws.dgamma[row_first + static_cast<int64_t>(tid) * Hv] = value;
  }
}

// Grid (max_chunks, Hk): the value heads that share key head blockIdx.y, one after the other, so
// that their dq and dk terms add up per key head (no fp32 copy per value head to reduce later).
__global__ void __launch_bounds__(kThreads, 2)
    grads_states_kernel(GatedDeltaRuleShape s, float scale, const __nv_bfloat16* q,
                        const __nv_bfloat16* k, const __nv_bfloat16* d_o,
                        const float* initial_state, const float* d_final_state, Workspace ws) {
  // The count, then the entry: these blocks run two value heads each, so the dependent round trip
  // matters little, and reading the entry before the test (load_chunk) costs grads_local spills.
  if (static_cast<int>(blockIdx.x) >= *ws.chunk_count) return;
  const ChunkInfo ci = ws.chunks[blockIdx.x];
  const int group = s.num_value_heads / s.num_key_heads, h0 = static_cast<int>(blockIdx.y) * group;
  for (int j = 0; j < group; ++j) {
    if (j > 0) __syncthreads();  // the previous head is done with the shared tiles
    grads_states_head(s, scale, q, k, d_o, initial_state, d_final_state, ws, ci, h0 + j, j == 0);
  }
}

// Shared tiles of the chunk-local gradient kernel (~99 KB: two blocks per SM, at 128 registers a
// thread without spills). Phases reuse the two 64 x 128 bf16 tiles: (V_new, d_o) -> (dW, dV_new) ->
// (dA A^T, q).
struct LocalSmem {
  alignas(16) __nv_bfloat16 k[kChunk * kBf16Stride];
  alignas(16) __nv_bfloat16 v[kChunk * kBf16Stride];
  alignas(16) __nv_bfloat16 a[kChunk * kSqBf16Stride];   // A = (I + L)^-1
  alignas(16) __nv_bfloat16 ge[kChunk * kSqBf16Stride];  // G_ij e^(gamma_i - gamma_j), j <= i
  alignas(16) __nv_bfloat16 da[kChunk * kSqBf16Stride];  // P, then dA, then C + C^T with C = dL beta_i e^(gamma_i - gamma_j)
  alignas(16) __nv_bfloat16 x1[kChunk * kBf16Stride];  // V_new, then dW, then t1 = dA A^T ([64][kSqBf16Stride])
  alignas(16) __nv_bfloat16 x2[kChunk * kBf16Stride];  // d_o, then dV_new, then q
  float gamma[kChunk], beta[kChunk], exp_gamma[kChunk];
  float d_gamma[kChunk], d_beta[kChunk], dx_dot_k[kChunk], dy_dot_v[kChunk];
  // Per-warp partial sums of d_gamma, added in warp order (d_gamma gets a start value and six
  // warps' terms: atomics would make its rounding depend on their arrival order).
  float d_gamma_slices[kThreads / 32][kChunk];
};

static_assert(2 * sizeof(LocalSmem) <= 227 * 1024 && sizeof(LocalSmem) <= kSm80MaxSharedBytesPerBlock,
              "two chunk-local gradient blocks must share an H200 SM, and one fit sm_80's 163 KB");

// Value head h of chunk ci: the chunk-local gradients, the intra-chunk attention term (G = do
// v_new^T), the UT transform (dA, dL = -A^T dA A^T), and the direct k, v, beta, gamma terms;
// writes dv, dbeta and dg (the reverse cumulative sum of d gamma) and adds the head's dq, dk terms
// to the key head's fp32 sums, which the group's last value head finishes into the bf16 dq, dk.
__device__ __forceinline__ void grads_local_head(const GatedDeltaRuleShape& s, float scale, const __nv_bfloat16* q,
                                                 const __nv_bfloat16* k, const __nv_bfloat16* v, const float* beta,
                                                 const __nv_bfloat16* d_o, __nv_bfloat16* dq, __nv_bfloat16* dk,
                                                 __nv_bfloat16* dv, float* dg, float* dbeta, const Workspace& ws,
                                                 const ChunkInfo& ci, int h, bool first_head, bool last_head) {
  const int Dk = s.key_dim, Dv = s.value_dim, Hk = s.num_key_heads, Hv = s.num_value_heads;
  const int kh = key_head_of(s, h), len = ci.len, tid = threadIdx.x, warp = tid >> 5;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  LocalSmem& sm = *reinterpret_cast<LocalSmem*>(smem_raw);
  const int64_t row_first = static_cast<int64_t>(ci.t0) * Hv + h;
  const int64_t key_row_first = static_cast<int64_t>(ci.t0) * Hk + kh;  // rows of q, k, dq, dk
  const int64_t qk_first = key_row_first * Dk;
  // Element (i, d) of the key head's dq or dk: the fp32 sum so far plus this head's term, kept for
  // the next head or, after the last, written in bf16 (times `factor`: dq's scale).
  // Two adjacent elements (d, d + 1) at a time: one 8-byte fp32 and one 4-byte bf16 access when Dk
  // is even and dq, dk sit on 4 bytes, else one by one.
  const bool pairs = Dk % 2 == 0 && ((reinterpret_cast<uintptr_t>(dq) | reinterpret_cast<uintptr_t>(dk)) & 3) == 0;
  // The sums are read before any is written, part of a warp tile at a time (for_each_tile_part).
  auto read_key_sums = [&](const float* sums, int i, int d) {
    if (i >= len || d >= Dk) return make_float2(0.0f, 0.0f);
    const int64_t at = (key_row_first + static_cast<int64_t>(i) * Hk) * Dk + d;
    if (pairs) return *reinterpret_cast<const float2*>(sums + at);
    return make_float2(sums[at], d + 1 < Dk ? sums[at + 1] : 0.0f);
  };
  auto finish_key_terms = [&](float* sums, __nv_bfloat16* out, int i, int d, float2 sum, float term0, float term1,
                              float factor) {
    const int64_t at = (key_row_first + static_cast<int64_t>(i) * Hk) * Dk + d;
    const float total0 = sum.x + term0, total1 = sum.y + term1;
    if (pairs) {
      if (last_head)
        *reinterpret_cast<__nv_bfloat162*>(out + at) = __floats2bfloat162_rn(factor * total0, factor * total1);
      else
        *reinterpret_cast<float2*>(sums + at) = make_float2(total0, total1);
      return;
    }
    for (int u = 0; u < 2 && d + u < Dk; ++u) {
      const float total = u == 0 ? total0 : total1;
      if (last_head) out[at + u] = __float2bfloat16(factor * total);
      else sums[at + u] = total;
    }
  };
  // A and P rows are stored at their tokens ([T, Hv, 64]); rows past len are not stored.
  const int64_t square_first = row_first * kChunk, square_row = static_cast<int64_t>(Hv) * kChunk;
  auto row_of = [&](int i) { return row_first + static_cast<int64_t>(i) * Hv; };
  __nv_bfloat16* d_o_tile = sm.x2;
  __nv_bfloat16* q_tile = sm.x2;  // later, same place
  __nv_bfloat16* t1 = sm.x1;      // later, [64][kSqBf16Stride]

  // k is the key head's, the same for every value head of the group, and only read: loaded once.
  if (first_head) load_tile(sm.k, kBf16Stride, kChunk, kD, k + qk_first, static_cast<int64_t>(Hk) * Dk, len, Dk);
  load_tile(sm.v, kBf16Stride, kChunk, kD, v + row_first * Dv, static_cast<int64_t>(Hv) * Dv, len,
            Dv);
  // Rows of A past len load as zeros (A holds identity rows there): every product below meets
  // them only against zero rows (dW, dV_new, dA past len) or in outputs past len, so it is exact.
  load_tile(sm.a, kSqBf16Stride, kChunk, kChunk, ws.a_inv + square_first, square_row, len, kChunk);
  load_tile(sm.x1, kBf16Stride, kChunk, kD, ws.v_new + row_first * Dv,
            static_cast<int64_t>(Hv) * Dv, len, Dv);
  load_tile(d_o_tile, kBf16Stride, kChunk, kD, d_o + row_first * Dv, static_cast<int64_t>(Hv) * Dv,
            len, Dv);
  // P rides in dA's tile (free until dA is formed) for M = G o P below, instead of a scattered
  // 2-byte global load per element.
  __nv_bfloat16* const p_tile = sm.da;
  load_tile(p_tile, kSqBf16Stride, kChunk, kChunk, ws.p + square_first, square_row, len, kChunk);
  if (tid < kChunk) {
    const bool valid = tid < len;
    sm.gamma[tid] = valid ? ws.gamma[row_of(tid)] : 0.0f;
    sm.beta[tid] = valid ? beta[row_of(tid)] : 0.0f;
    sm.exp_gamma[tid] = expf(sm.gamma[tid]);
    sm.d_gamma[tid] = valid ? ws.dgamma[row_of(tid)] : 0.0f;
    sm.d_beta[tid] = sm.dx_dot_k[tid] = sm.dy_dot_v[tid] = 0.0f;
  }
  wait_tile_loads();
  __syncthreads();
  // 64 x 64 products: warp tile rows 16 (warp % 4), columns 32 (warp / 4).
  const int sm0 = 16 * (warp & 3), sn0 = 32 * (warp >> 2);
  // 64 x 128 products: warp tile rows 16 (warp % 4), columns 64 (warp / 4).
  const int m0 = 16 * (warp & 3), n0 = 64 * (warp >> 2);
  // dk or dq: the key head's sums plus this head's terms `acc`, read in kParts pieces.
  constexpr int kParts = 2;
  auto finish_key_tile = [&](float* sums, __nv_bfloat16* out, const float (&acc)[1][8][4], float factor) {
    for_each_tile_part<kParts>([&](int piece) {
      float2 old[8 / kParts][2];
      for_each_acc_pair<1, 8>(m0, n0, [&](int, int nt, int half, int i, int d) {
        if (nt / (8 / kParts) == piece) old[nt % (8 / kParts)][half] = read_key_sums(sums, i, d);
      });
      for_each_acc_pair<1, 8>(m0, n0, [&](int mt, int nt, int half, int i, int d) {
        if (nt / (8 / kParts) == piece && i < len && d < Dk)
          finish_key_terms(sums, out, i, d, old[nt % (8 / kParts)][half], acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1],
                           factor);
      });
    });
  };
  {
    // G_ij = do_i . v_new_j (j <= i): intra-chunk output term; M_ij = G_ij P_ij moves gamma.
    float acc[1][4][4], m_plus[1][4][4], m_minus[1][4][4];
    zero_acc(acc);
    warp_mma<1, 4, kD>(acc, rows_of<kBf16Stride>(d_o_tile), sm0, transposed<kBf16Stride>(sm.x1), sn0);
    for_each_acc<1, 4>(sm0, sn0, [&](int mt, int nt, int r, int i, int j) {
      float ge = 0.0f, m = 0.0f;
      if (i < len && j <= i) {
        ge = acc[mt][nt][r] * expf(sm.gamma[i] - sm.gamma[j]);
        if (j < i) m = acc[mt][nt][r] * __bfloat162float(p_tile[i * kSqBf16Stride + j]);
      }
      sm.ge[i * kSqBf16Stride + j] = __float2bfloat16(ge);
      m_plus[mt][nt][r] = m;
      m_minus[mt][nt][r] = -m;
    });
    float* slice = sm.d_gamma_slices[warp];
    clear_warp_slice(slice, kChunk);
    stage_row_sums(m_plus, sm0, slice);
    stage_col_sums(m_minus, sn0, slice);
  }
  add_warp_slices(sm.d_gamma, &sm.d_gamma_slices[0][0], kThreads / 32, kChunk);
  load_tile(sm.x1, kBf16Stride, kChunk, kD, ws.dw + row_first * Dk, static_cast<int64_t>(Hv) * Dk,
            len, Dk);
  load_tile(sm.x2, kBf16Stride, kChunk, kD, ws.dv_new + row_first * Dv,
            static_cast<int64_t>(Hv) * Dv, len, Dv);
  wait_tile_loads();
  __syncthreads();
  {
    // dA_ij = beta_j e^gamma_j (dW_i . k_j) + beta_j (dV_new_i . v_j) on the strict lower part.
    float acc_w[1][4][4], acc_u[1][4][4];
    zero_acc(acc_w);
    zero_acc(acc_u);
    warp_mma<1, 4, kD>(acc_w, rows_of<kBf16Stride>(sm.x1), sm0, transposed<kBf16Stride>(sm.k), sn0);
    warp_mma<1, 4, kD>(acc_u, rows_of<kBf16Stride>(sm.x2), sm0, transposed<kBf16Stride>(sm.v), sn0);
    for_each_acc<1, 4>(sm0, sn0, [&](int mt, int nt, int r, int i, int j) {
      float value = 0.0f;
      if (i < len && j < i)
        value = sm.beta[j] * (sm.exp_gamma[j] * acc_w[mt][nt][r] + acc_u[mt][nt][r]);
      sm.da[i * kSqBf16Stride + j] = __float2bfloat16(value);
    });
  }
  // dX = A^T dW gives k's direct term beta e^gamma dX (kept until dk is written below).
  float dk_direct[1][8][4];
  {
    float acc[1][8][4], part[1][8][4];
    zero_acc(dk_direct);
    warp_mma<1, 8, kChunk>(dk_direct, transposed<kSqBf16Stride>(sm.a), m0, rows_of<kBf16Stride>(sm.x1),
                           n0);
    for_each_acc<1, 8>(m0, n0, [&](int mt, int nt, int r, int i, int d) {
      const float dx = dk_direct[mt][nt][r];
      part[mt][nt][r] = dx * __bfloat162float(sm.k[i * kBf16Stride + d]);  // zero rows past len
      dk_direct[mt][nt][r] = sm.beta[i] * sm.exp_gamma[i] * dx;
    });
    add_row_sums(part, m0, sm.dx_dot_k);
    // dv = beta dY with dY = A^T dV_new (dU = dV_new).
    zero_acc(acc);
    warp_mma<1, 8, kChunk>(acc, transposed<kSqBf16Stride>(sm.a), m0, rows_of<kBf16Stride>(sm.x2), n0);
    for_each_acc<1, 8>(m0, n0, [&](int mt, int nt, int r, int i, int e) {
      part[mt][nt][r] = 0.0f;
      if (i < len && e < Dv) {
        dv[row_of(i) * Dv + e] = __float2bfloat16(sm.beta[i] * acc[mt][nt][r]);
        part[mt][nt][r] = acc[mt][nt][r] * __bfloat162float(sm.v[i * kBf16Stride + e]);
      }
    });
    add_row_sums(part, m0, sm.dy_dot_v);
  }
  __syncthreads();
  // dW and dV_new are done: q goes where dV_new was, t1 where dW was.
  load_tile(q_tile, kBf16Stride, kChunk, kD, q + qk_first, static_cast<int64_t>(Hk) * Dk, len, Dk);
  {
    // t1 = dA A^T: t1[a][j] = sum_b dA[a][b] A[j][b].
    float acc[1][4][4];
    zero_acc(acc);
    warp_mma<1, 4, kChunk>(acc, rows_of<kSqBf16Stride>(sm.da), sm0, transposed<kSqBf16Stride>(sm.a), sn0);
    for_each_acc<1, 4>(sm0, sn0, [&](int mt, int nt, int r, int a, int j) {
      t1[a * kSqBf16Stride + j] = __float2bfloat16(acc[mt][nt][r]);
    });
  }
  __syncthreads();
  {
    // dL = -A^T t1 on the strict lower part; L_ij = beta_i (k_i . k_j) e^(gamma_i - gamma_j).
    // da is free now and receives C + C^T, C_ij = dL_ij beta_i e^(gamma_i - gamma_j) strictly
    // lower (dk gets (C + C^T) K): the owner of (i, j), i > j, also writes the mirror (j, i).
    float acc[1][4][4], kk[1][4][4], f[1][4][4], bf_plus[1][4][4], bf_minus[1][4][4];
    zero_acc(acc);
    zero_acc(kk);
    warp_mma<1, 4, kChunk>(acc, transposed<kSqBf16Stride>(sm.a), sm0, rows_of<kSqBf16Stride>(t1), sn0);
    warp_mma<1, 4, kD>(kk, rows_of<kBf16Stride>(sm.k), sm0, transposed<kBf16Stride>(sm.k), sn0);
    for_each_acc<1, 4>(sm0, sn0, [&](int mt, int nt, int r, int i, int j) {
      float c_value = 0.0f, f_value = 0.0f;
      if (i < len && j < i) {
        const float dl = -acc[mt][nt][r];
        const float decay = expf(sm.gamma[i] - sm.gamma[j]);
        f_value = dl * kk[mt][nt][r] * decay;
        c_value = dl * sm.beta[i] * decay;
      }
      f[mt][nt][r] = f_value;
      bf_plus[mt][nt][r] = sm.beta[i] * f_value;
      bf_minus[mt][nt][r] = -sm.beta[i] * f_value;
      if (j < i) {
        sm.da[i * kSqBf16Stride + j] = __float2bfloat16(c_value);
        sm.da[j * kSqBf16Stride + i] = __float2bfloat16(c_value);
      } else if (j == i) {
        sm.da[i * kSqBf16Stride + j] = __float2bfloat16(0.0f);
      }
    });
    add_row_sums(f, sm0, sm.d_beta);  // two warps per row onto zero: commutative, deterministic
    float* slice = sm.d_gamma_slices[warp];
    clear_warp_slice(slice, kChunk);
    stage_row_sums(bf_plus, sm0, slice);
    stage_col_sums(bf_minus, sn0, slice);
  }
  add_warp_slices(sm.d_gamma, &sm.d_gamma_slices[0][0], kThreads / 32, kChunk);
  wait_tile_loads();
  __syncthreads();
  float acc[1][8][4];
  // dk first, which frees dk_direct's registers before dq's product.
  // dk_i += beta_i e^gamma_i dX_i + scale sum_a G_ai e^(gamma_a - gamma_i) q_a
  //         + sum_j (C_ij + C_ji) k_j, summed over the group.
  zero_acc(acc);
  warp_mma<1, 8, kChunk>(acc, transposed<kSqBf16Stride>(sm.ge), m0, rows_of<kBf16Stride>(q_tile), n0);
  for_each_acc<1, 8>(m0, n0, [&](int mt, int nt, int r, int, int) {
    acc[mt][nt][r] = scale * acc[mt][nt][r] + dk_direct[mt][nt][r];
  });
  warp_mma<1, 8, kChunk>(acc, rows_of<kSqBf16Stride>(sm.da), m0, rows_of<kBf16Stride>(sm.k), n0);
  finish_key_tile(ws.dk_acc, dk, acc, 1.0f);
  // dq_i = scale (dq_acc_i + sum_{j<=i} G_ij e^(gamma_i - gamma_j) k_j), summed over the group.
  zero_acc(acc);
  warp_mma<1, 8, kChunk>(acc, rows_of<kSqBf16Stride>(sm.ge), m0, rows_of<kBf16Stride>(sm.k), n0);
  finish_key_tile(ws.dq_acc, dq, acc, scale);
  __syncthreads();
  if (warp == 0) {
    // gamma is the chunk-local prefix sum of g, so dg is the reverse cumulative sum of d gamma:
    // lane l takes tokens 2l and 2l + 1, a suffix scan over the lanes sums the pairs after its own.
    static_assert(kChunk == 64, "two tokens a lane");
    const int lane = tid & 31, i0 = 2 * lane, i1 = i0 + 1;
    auto term = [&](int i) {
      return i < len ? sm.d_gamma[i] + sm.beta[i] * sm.exp_gamma[i] * sm.dx_dot_k[i] : 0.0f;
    };
    const float v0 = term(i0), v1 = term(i1);
    float pairs_from_here = v0 + v1;  // becomes the sum over the pairs of lanes >= lane
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const float later = __shfl_down_sync(0xffffffffu, pairs_from_here, offset);
      if (lane + offset < 32) pairs_from_here += later;
    }
    const float after = __shfl_down_sync(0xffffffffu, pairs_from_here, 1);
    const float suffix1 = (lane < 31 ? after : 0.0f) + v1, suffix0 = suffix1 + v0;
    if (i0 < len) {
      dg[row_of(i0)] = suffix0;
      dbeta[row_of(i0)] = sm.d_beta[i0] + sm.exp_gamma[i0] * sm.dx_dot_k[i0] + sm.dy_dot_v[i0];
    }
    if (i1 < len) {
      dg[row_of(i1)] = suffix1;
      dbeta[row_of(i1)] = sm.d_beta[i1] + sm.exp_gamma[i1] * sm.dx_dot_k[i1] + sm.dy_dot_v[i1];
    }
  }
}

// Grid (max_chunks, Hk): the value heads that share key head blockIdx.y, one after the other; the
// last one writes the key head's dq and dk.
__global__ void __launch_bounds__(kThreads, 2)
    grads_local_kernel(GatedDeltaRuleShape s, float scale, const __nv_bfloat16* q,
                       const __nv_bfloat16* k, const __nv_bfloat16* v, const float* beta,
                       const __nv_bfloat16* d_o, __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                       float* dg, float* dbeta, Workspace ws) {
  // The count, then the entry: these blocks run two value heads each, so the dependent round trip
  // matters little, and reading the entry before the test (load_chunk) costs grads_local spills.
  if (static_cast<int>(blockIdx.x) >= *ws.chunk_count) return;
  const ChunkInfo ci = ws.chunks[blockIdx.x];
  const int group = s.num_value_heads / s.num_key_heads, h0 = static_cast<int>(blockIdx.y) * group;
  for (int j = 0; j < group; ++j) {
    if (j > 0) __syncthreads();  // the previous head is done with the shared tiles
    grads_local_head(s, scale, q, k, v, beta, d_o, dq, dk, dv, dg, dbeta, ws, ci, h0 + j, j == 0, j == group - 1);
  }
}

}  // namespace
}  // namespace gdn_cuda

size_t gated_delta_rule_backward_workspace_bytes(const GatedDeltaRuleShape& shape) {
  return gdn_cuda::carve_workspace(shape, true, nullptr, nullptr);
}

namespace gdn_cuda {

void run_backward(const GatedDeltaRuleShape& shape, float scale, const __nv_bfloat16* q,
                  const __nv_bfloat16* k, const __nv_bfloat16* v, const float* g, const float* beta,
                  const float* initial_state, const __nv_bfloat16* d_o, const float* d_final_state,
                  __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, float* dg, float* dbeta,
                  float* d_initial_state, const Workspace& ws, cudaStream_t stream,
                  StageMarks* marks, bool recompute_forward) {
  const bool has_tokens = shape.num_tokens > 0;
  mark_stage(marks, "backward start", stream);
  // Recompute the forward chunk quantities, the chunk-entry states H and V_new (unless the
  // caller kept the forward's workspace: the same values).
  if (recompute_forward) {
    launch_build_chunk_table(shape, ws, stream);
    if (has_tokens) launch_prepare_chunks(shape, scale, q, k, v, g, beta, ws, stream);
    mark_stage(marks, "backward recompute prepare", stream);
    launch_state_scan(shape, k, initial_state, nullptr, ws, stream);
    mark_stage(marks, "backward recompute state scan", stream);
  }
  // Reverse scan: dH per chunk, dV_new, and d_initial_state (= d_final_state without tokens).
  {
    // The shared tiles fit sm_80's 163 KB too (checked at compile time above).
    const dim3 grid(shape.num_seqs, shape.num_value_heads, (shape.value_dim + kDScanCols - 1) / kDScanCols);
    allow_smem(dstate_scan_kernel<kDScanCols>, sizeof(DScanSmem<kDScanCols>));
    dstate_scan_kernel<kDScanCols><<<grid, kThreads, sizeof(DScanSmem<kDScanCols>), stream>>>(
        shape, scale, q, k, d_o, d_final_state, d_initial_state, ws);
  }
  CUDA_CHECK_LAUNCH();
  mark_stage(marks, "backward dstate scan", stream);
  if (!has_tokens) return;
  // One block per chunk and key head: its value heads in turn (their dq, dk add up in the block).
  const dim3 chunk_grid(static_cast<unsigned>(max_chunks(shape)), shape.num_key_heads);
  const size_t states_smem = sizeof(StatesSmem);
  allow_smem(grads_states_kernel, states_smem);
  grads_states_kernel<<<chunk_grid, kThreads, states_smem, stream>>>(
      shape, scale, q, k, d_o, initial_state, d_final_state, ws);
  CUDA_CHECK_LAUNCH();
  mark_stage(marks, "backward grads_states", stream);
  const size_t local_smem = sizeof(LocalSmem);
  allow_smem(grads_local_kernel, local_smem);
  grads_local_kernel<<<chunk_grid, kThreads, local_smem, stream>>>(shape, scale, q, k, v, beta, d_o, dq, dk, dv,
                                                                   dg, dbeta, ws);
  CUDA_CHECK_LAUNCH();
  mark_stage(marks, "backward grads_local", stream);
}


}  // namespace gdn_cuda

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
  // Its slots are read with 16-byte accesses from 256-byte aligned offsets.
  CHECK(reinterpret_cast<uintptr_t>(workspace) % 256 == 0, "gated_delta_rule_backward_cuda: the workspace must be "
        "256-byte aligned");
  Workspace ws{};
  carve_workspace(shape, true, workspace, &ws);
  run_backward(shape, scale, q, k, v, g, beta, initial_state, d_o, d_final_state, dq, dk, dv, dg,
               dbeta, d_initial_state, ws, stream, nullptr);
}

size_t gated_delta_rule_backward_after_forward_workspace_bytes(const GatedDeltaRuleShape& shape) {
  return gdn_cuda::carve_backward_after_forward(shape, nullptr, nullptr, nullptr);
}

void gated_delta_rule_backward_after_forward_cuda(const GatedDeltaRuleShape& shape, float scale,
                                                  const __nv_bfloat16* q, const __nv_bfloat16* k,
                                                  const __nv_bfloat16* v, const float* g, const float* beta,
                                                  const float* initial_state, const __nv_bfloat16* d_o,
                                                  const float* d_final_state, __nv_bfloat16* dq, __nv_bfloat16* dk,
                                                  __nv_bfloat16* dv, float* dg, float* dbeta,
                                                  float* d_initial_state, const void* forward_workspace,
                                                  size_t forward_workspace_bytes, void* workspace,
                                                  size_t workspace_bytes, cudaStream_t stream) {
  using namespace gdn_cuda;
  const char* where = "gated_delta_rule_backward_after_forward_cuda";
  check_shape(where, shape);
  const size_t forward_needed = gated_delta_rule_forward_workspace_bytes(shape);
  const size_t needed = gated_delta_rule_backward_after_forward_workspace_bytes(shape);
  CHECK(forward_workspace != nullptr && forward_workspace_bytes >= forward_needed, where,
        ": the forward's workspace of ", forward_workspace_bytes, " bytes, its layout takes ", forward_needed);
  CHECK(workspace != nullptr && workspace_bytes >= needed, where, ": workspace of ", workspace_bytes,
        " bytes, need ", needed);
  CHECK(reinterpret_cast<uintptr_t>(workspace) % 256 == 0 && reinterpret_cast<uintptr_t>(forward_workspace) % 256 == 0,
        where, ": both workspaces must be 256-byte aligned");
  const auto* kept = static_cast<const char*>(forward_workspace);
  const auto* own = static_cast<const char*>(workspace);
  CHECK(own + needed <= kept || kept + forward_needed <= own, where,
        ": the backward's workspace overlaps the kept forward's");
  Workspace ws{};
  carve_backward_after_forward(shape, forward_workspace, workspace, &ws);
  run_backward(shape, scale, q, k, v, g, beta, initial_state, d_o, d_final_state, dq, dk, dv, dg, dbeta,
               d_initial_state, ws, stream, nullptr, false);
}

}  // namespace deltamoe
