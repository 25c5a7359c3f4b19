// Internals shared by the forward and backward CUDA files of the gated delta rule: the chunk
// table, the workspace pointers, shared-tile strides, and the launchers of the stages both
// directions run (chunk preparation and the forward state scan).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/cuda_check.h"
#include "kernels/gated_delta_rule/gated_delta_rule.h"
#include "kernels/gated_delta_rule/gated_delta_rule_cuda.h"
#include "kernels/gated_delta_rule/gated_delta_rule_workspace.h"
#include "kernels/gated_delta_rule/gdn_mma.cuh"

namespace deltamoe::gdn_cuda {

constexpr int kChunk = kGatedDeltaRuleChunkSize;  // 64 tokens
constexpr int kThreads = 256;                     // threads of every block (8 warps)
constexpr int kD = kGatedDeltaRuleCudaMaxHeadDim;  // every head dim is zero-padded to 128 in shared
constexpr int kScanCols = 64;  // state columns of one output block (Dv / 64 blocks per head)
// Shared row strides (elements), chosen so that the mma fragment reads (gdn_mma.cuh, warp_mma)
// hit distinct banks: fp32 tiles whose k-adjacent pairs lie side by side in a row (row-major A,
// transposed B) take 8 (mod 32) words per row, those whose pairs lie one row apart 4 (mod 32).
// bf16 rows of 8 (mod 16) elements are 4 (mod 32) words: the k-adjacent pairs of row-major reads
// hit distinct banks, and every row starts on 16 bytes for the asynchronous copies.
constexpr int kBf16Stride = kD + 8;       // [rows][128] bf16 tiles (q, k, v, d_o, W, V_new, H, ...)
constexpr int kSqStride = kChunk + 8;     // [64][64] fp32 (L and the inverse's scratch) read as row-major A
constexpr int kSqBf16Stride = kChunk + 8;  // [64][64] bf16 (A, P, G, dA, ...)
constexpr int kColBf16Stride = kScanCols + 8;  // [rows][64] bf16 column slices

// One chunk: tokens [t0, t0 + len) of sequence `seq`, and where its boundary states live
// (gated_delta_rule_workspace.h): h_slot holds the state entering the chunk, -1 when the chunk
// begins its sequence (it enters with the sequence's initial state); dh_slot holds dL/d(state
// leaving the chunk), -1 when the chunk ends its sequence (that is dL/d final state). Inside a
// sequence chunk c + 1's h_slot is chunk c's dh_slot.
struct ChunkInfo {
  int t0;
  int len;
  int seq;
  int h_slot;
  int dh_slot;
};
static_assert(sizeof(ChunkInfo) == kGatedDeltaRuleChunkInfoBytes,
              "the workspace layout counts chunk-table entries of this size");

// Chunk i of sequence `seq` (tokens [begin, end), first state slot slot0): the table's entry,
// computed. Boundary b, between the sequence's chunks b and b + 1, is slot slot0 + b. The scans
// use it instead of the table, so that no step waits on a table read to address its inputs.
__device__ __forceinline__ ChunkInfo sequence_chunk(int begin, int end, int seq, int slot0, int i) {
  const int t0 = begin + i * kChunk;
  const bool last = t0 + kChunk >= end;
  return ChunkInfo{t0, min(kChunk, end - t0), seq, i > 0 ? slot0 + i - 1 : -1, last ? -1 : slot0 + i};
}

// Upper bound of the chunk count: every sequence adds at most one partial chunk.
inline int64_t max_chunks(const GatedDeltaRuleShape& s) {
  return gated_delta_rule_max_chunks(s.num_tokens, s.num_seqs);
}

// Device pointers into the caller's workspace (layout: gated_delta_rule_workspace.h). Token-
// indexed arrays follow the [T, Hv, ...] layout; the 64 x 64 per-chunk matrices are stored by
// rows, row i of a chunk at its token t0 + i ([T, Hv, 64]); the boundary states by slot.
// The operands of the products are bf16 (single tensor-core products; gated_delta_rule_notes.md,
// "bf16 intermediates"): W, U / V_new, P, A, the boundary states and dV_new. The running states
// of the two scans, the gates and every accumulation stay fp32.
// The backward reads the forward's arrays and writes only its own (below): a caller may keep a
// forward's workspace for one or more backwards (carve_backward_after_forward), so no backward
// kernel may write chunks .. h.
struct Workspace {
  ChunkInfo* chunks;     // [max_chunks]
  int* chunk_count;      // [1] chunks actually used
  int* chunk_offsets;    // [N+1] first chunk of each sequence
  int* slot_offsets;     // [N+1] first state slot of each sequence
  float* gamma;          // [T, Hv] cumulative log decay inside the chunk
  __nv_bfloat16* w;      // [T, Hv, Dk] W = A diag(beta e^gamma) K
  __nv_bfloat16* v_new;  // [T, Hv, Dv] U, then V_new = U - W H in place
  __nv_bfloat16* p;      // [T, Hv, 64] (scale q_i . k_j) e^(gamma_i - gamma_j), j <= i
  __nv_bfloat16* a_inv;  // [T, Hv, 64] A = (I + L)^-1
  __nv_bfloat16* h;      // [slots, Hv, Dk, Dv] state entering a chunk (ChunkInfo::h_slot)
  // Backward only (null in the forward layout):
  __nv_bfloat16* dh;      // [slots, Hv, Dk, Dv] dL/d(state leaving a chunk) (ChunkInfo::dh_slot)
  __nv_bfloat16* dv_new;  // [T, Hv, Dv]
  __nv_bfloat16* dw;      // [T, Hv, Dk]
  float* dq_acc;          // [T, Hk, Dk] fp32, summed over the key head's value heads
  float* dk_acc;          // [T, Hk, Dk]
  float* dgamma;          // [T, Hv] partial d gamma from the state terms
};

// A forward per-chunk block's table entry; false: the block's chunk is past the count and it has
// no work (the table's build zeroes those entries, and every used chunk holds at least one token).
// Testing the entry's own length instead of the count saves a dependent round trip before the
// tiles can be addressed, and the volatile reads keep the compiler from sinking the start token's
// load below the test. (The backward's two-head blocks read the count first: the early entry
// cost grads_local 48-52 bytes of spills at its 128 registers.)
__device__ __forceinline__ bool load_chunk(const Workspace& ws, int chunk, ChunkInfo* ci) {
  const volatile ChunkInfo* entry = ws.chunks + chunk;
  ci->t0 = entry->t0;
  ci->len = entry->len;
  ci->seq = entry->seq;
  ci->h_slot = entry->h_slot;
  ci->dh_slot = entry->dh_slot;
  return ci->len > 0;
}

// Where a [Dk, Dv] boundary state (or its gradient) comes from: a bf16 slot of the workspace, or
// the caller's fp32 initial state / d_final_state at a sequence's ends; both null means zeros.
struct StateSource {
  const __nv_bfloat16* slot = nullptr;
  const float* caller = nullptr;
};

// A boundary state of head h (or its gradient): bf16 slot `slot` of `slots`, or where the chunk
// has none (-1: its sequence's end) the caller's fp32 state of sequence seq (zeros when null).
__device__ inline StateSource boundary_state(const GatedDeltaRuleShape& s, const __nv_bfloat16* slots, int slot,
                                             const float* caller, int seq, int h) {
  const int64_t block = static_cast<int64_t>(s.key_dim) * s.value_dim;
  StateSource source;
  if (slot >= 0)
    source.slot = slots + (static_cast<int64_t>(slot) * s.num_value_heads + h) * block;
  else if (caller != nullptr)
    source.caller = caller + (static_cast<int64_t>(seq) * s.num_value_heads + h) * block;
  return source;
}

// The state of head h entering chunk ci: its slot, or for a chunk that begins its sequence the
// sequence's initial state.
__device__ inline StateSource entering_state(const GatedDeltaRuleShape& s, const Workspace& ws,
                                             const ChunkInfo& ci, const float* initial_state, int h) {
  return boundary_state(s, ws.h, ci.h_slot, initial_state, ci.seq, h);
}

// Same for dL/d(state leaving chunk ci): its slot, or d_final_state for a sequence's last chunk.
__device__ inline StateSource leaving_state_grad(const GatedDeltaRuleShape& s, const Workspace& ws,
                                                 const ChunkInfo& ci, const float* d_final_state, int h) {
  return boundary_state(s, ws.dh, ci.dh_slot, d_final_state, ci.seq, h);
}

// Block-wide: columns [col0, col0 + tile_cols) of a [Dk, Dv] boundary state into a bf16 tile of
// kD rows (row stride dst_stride), zeros past Dk rows and `cols` columns. A slot is copied
// asynchronously (wait_tile_loads() and __syncthreads() before reading the tile); the caller's
// fp32 state is rounded to bf16 on the way, as the slots were.
__device__ inline void load_state_tile(__nv_bfloat16* dst, int dst_stride, int tile_cols, const StateSource& src,
                                       const GatedDeltaRuleShape& s, int col0, int cols) {
  const int Dk = s.key_dim, Dv = s.value_dim;
  if (src.slot != nullptr) {
    load_tile(dst, dst_stride, kD, tile_cols, src.slot + col0, Dv, Dk, cols);
    return;
  }
  for (int idx = threadIdx.x; idx < kD * tile_cols; idx += blockDim.x) {
    const int d = idx / tile_cols, e = idx - d * tile_cols;
    const float value =
        src.caller != nullptr && d < Dk && e < cols ? src.caller[static_cast<int64_t>(d) * Dv + col0 + e] : 0.0f;
    dst[d * dst_stride + e] = __float2bfloat16(value);
  }
}

// Block-wide: rows [0, rows) of a bf16 shared tile (row stride kTileStride, kTileCols columns of
// which the first `cols` are kept) to global rows `row_stride` elements apart from dst, 16 bytes at
// a time: a warp's fragments alone would store scattered 2-byte values. kTileCols, cols, row_stride
// and dst's offset are multiples of 8 elements.
template <int kTileCols, int kTileStride, int kBlockThreads>
__device__ __forceinline__ void copy_tile_rows(__nv_bfloat16* dst, int64_t row_stride, const __nv_bfloat16* tile,
                                               int rows, int cols) {
  static_assert(kTileCols % 8 == 0 && kTileStride % 8 == 0, "whole 16-byte pieces of a row");
  for (int idx = threadIdx.x; idx < rows * (kTileCols / 8); idx += kBlockThreads) {
    const int i = idx / (kTileCols / 8), e = 8 * (idx % (kTileCols / 8));
    if (e < cols)
      *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(i) * row_stride + e) =
          *reinterpret_cast<const uint4*>(&tile[i * kTileStride + e]);
  }
}

// Block-wide: stores columns [col0, col0 + cols) of a state slot (the caller offsets `slot` by col0)
// from a bf16 tile of kCols columns (row stride tile_stride), Dk rows; 16-byte stores when Dv % 8
// == 0 (then cols, col0 and the slot's rows are multiples of 8 elements).
template <int kCols>
__device__ inline void store_state_slice(__nv_bfloat16* slot, const __nv_bfloat16* tile, int tile_stride,
                                         const GatedDeltaRuleShape& s, int cols) {
  const int Dk = s.key_dim, Dv = s.value_dim;
  if (Dv % 8 == 0) {
    for (int idx = threadIdx.x; idx < Dk * kCols / 8; idx += blockDim.x) {
      const int d = idx / (kCols / 8), e = 8 * (idx % (kCols / 8));
      if (e < cols)
        *reinterpret_cast<uint4*>(slot + static_cast<int64_t>(d) * Dv + e) =
            *reinterpret_cast<const uint4*>(&tile[d * tile_stride + e]);
    }
  } else {
    for (int idx = threadIdx.x; idx < Dk * kCols; idx += blockDim.x) {
      const int d = idx / kCols, e = idx % kCols;
      if (e < cols) slot[static_cast<int64_t>(d) * Dv + e] = tile[d * tile_stride + e];
    }
  }
}

// The running fp32 state of a scan (or its gradient) as the warp's accumulator tile of the state
// update: rows 16 warp, all kCols columns of [col0, col0 + kCols), one fragment per lane. Loaded
// from the caller's fp32 [Dk, Dv] state at `base` (already offset by col0; null: zeros, as are rows
// past Dk and columns past `cols`), with its bf16 copy written into a shared tile of row stride
// `bf16_stride`; stored back to the caller's array (rows < Dk, columns < cols).
template <int kCols>
using RunningState = float[1][kCols / 8][4];

template <int kCols>
__device__ __forceinline__ void load_running_state(RunningState<kCols>& state, const float* base,
                                                   const GatedDeltaRuleShape& s, int cols,
                                                   __nv_bfloat16* bf16_tile, int bf16_stride) {
  for_each_acc<1, kCols / 8>(16 * (static_cast<int>(threadIdx.x) >> 5), 0, [&](int mt, int nt, int r, int d, int e) {
    const float value =
        (base != nullptr && d < s.key_dim && e < cols) ? base[static_cast<int64_t>(d) * s.value_dim + e] : 0.0f;
    state[mt][nt][r] = value;
    bf16_tile[d * bf16_stride + e] = __float2bfloat16(value);
  });
}

template <int kCols>
__device__ __forceinline__ void store_running_state(const RunningState<kCols>& state, float* base,
                                                    const GatedDeltaRuleShape& s, int cols) {
  for_each_acc<1, kCols / 8>(16 * (static_cast<int>(threadIdx.x) >> 5), 0, [&](int mt, int nt, int r, int d, int e) {
    if (d < s.key_dim && e < cols) base[static_cast<int64_t>(d) * s.value_dim + e] = state[mt][nt][r];
  });
}

// Carves the workspace (base may be null to measure); returns the bytes needed.
size_t carve_workspace(const GatedDeltaRuleShape& shape, bool backward, void* base,
                       Workspace* out);
// The backward's arrays from `base` and the forward's from a kept forward workspace; returns the
// bytes `base` needs (null out: just that).
size_t carve_backward_after_forward(const GatedDeltaRuleShape& shape, const void* forward, void* base,
                                    Workspace* out);

void check_shape(const char* op, const GatedDeltaRuleShape& shape);

// Shared memory one block may opt into on the current kernel path. Every kernel's shared tiles fit
// sm_80's 163 KB (static_asserts beside each; one kernel per stage for both architectures), and
// allow_smem fails loudly past the limit.
size_t device_smem_limit();

// Optional CUDA events between stages, for the stage-time benchmark (null everywhere else).
struct StageMarks {
  static constexpr int kMax = 16;
  cudaEvent_t events[kMax];
  const char* names[kMax];
  int count = 0;
};

inline void mark_stage(StageMarks* marks, const char* name, cudaStream_t stream) {
  if (marks == nullptr || marks->count >= StageMarks::kMax) return;
  CUDA_CHECK(cudaEventRecord(marks->events[marks->count], stream));
  marks->names[marks->count++] = name;
}

// The whole forward / backward on a carved workspace, marking each stage's end.
void run_forward(const GatedDeltaRuleShape& shape, float scale, const __nv_bfloat16* q,
                 const __nv_bfloat16* k, const __nv_bfloat16* v, const float* g, const float* beta,
                 const float* initial_state, __nv_bfloat16* o, float* final_state,
                 const Workspace& ws, cudaStream_t stream, StageMarks* marks);
void run_backward(const GatedDeltaRuleShape& shape, float scale, const __nv_bfloat16* q,
                  const __nv_bfloat16* k, const __nv_bfloat16* v, const float* g, const float* beta,
                  const float* initial_state, const __nv_bfloat16* d_o, const float* d_final_state,
                  __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, float* dg, float* dbeta,
                  float* d_initial_state, const Workspace& ws, cudaStream_t stream,
                  StageMarks* marks, bool recompute_forward = true);

// Stages both directions run, in this order on one stream.
void launch_build_chunk_table(const GatedDeltaRuleShape& shape, const Workspace& ws,
                              cudaStream_t stream);
void launch_prepare_chunks(const GatedDeltaRuleShape& shape, float scale, const __nv_bfloat16* q,
                           const __nv_bfloat16* k, const __nv_bfloat16* v, const float* g,
                           const float* beta, const Workspace& ws, cudaStream_t stream);
void launch_state_scan(const GatedDeltaRuleShape& shape, const __nv_bfloat16* k,
                       const float* initial_state, float* final_state, const Workspace& ws,
                       cudaStream_t stream);

// Loads the gates of one chunk (warp 0 only; lane l holds tokens 2l and 2l + 1): gamma = the
// chunk-local inclusive cumulative sum of g, beta, e^gamma; zeros past len (gamma keeps its last
// value). Writes gamma to gamma_out ([T, Hv] row of the chunk's first token) when not null.
__device__ inline void load_chunk_gates(const float* g, const float* beta, int64_t first_row,
                                        int num_value_heads, int len, float* gamma, float* bet,
                                        float* exp_gamma, float* gamma_out) {
  const int lane = threadIdx.x & 31;
  float g_pair[2], b_pair[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int i = 2 * lane + u;
    const int64_t row = first_row + static_cast<int64_t>(i) * num_value_heads;
    g_pair[u] = i < len ? g[row] : 0.0f;
    b_pair[u] = i < len ? beta[row] : 0.0f;
  }
  float inclusive = g_pair[0] + g_pair[1];
  for (int offset = 1; offset < 32; offset <<= 1) {
    const float other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  const float exclusive = inclusive - (g_pair[0] + g_pair[1]);
  const float cum[2] = {exclusive + g_pair[0], exclusive + g_pair[0] + g_pair[1]};
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int i = 2 * lane + u;
    gamma[i] = cum[u];
    bet[i] = b_pair[u];
    exp_gamma[i] = expf(cum[u]);
    if (gamma_out != nullptr && i < len)
      gamma_out[first_row + static_cast<int64_t>(i) * num_value_heads] = cum[u];
  }
}

// Raises a kernel's dynamic shared memory limit (the big tiles need more than the default 48 KB).
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  const size_t limit = device_smem_limit();
  CHECK(bytes <= limit, "gated_delta_rule_cuda: needs ", bytes,
        " bytes of shared memory per block, the device allows ", limit);
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)));
}

// Block-wide helpers.
__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ inline int key_head_of(const GatedDeltaRuleShape& s, int h) {
  return h / (s.num_value_heads / s.num_key_heads);
}

}  // namespace deltamoe::gdn_cuda
