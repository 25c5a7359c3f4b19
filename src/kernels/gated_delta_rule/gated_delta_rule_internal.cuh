// Internals shared by the forward and backward CUDA files of the gated delta rule: the chunk
// table, the workspace layout, and the launchers of the stages both directions run (chunk
// preparation and the forward state scan).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/gated_delta_rule/gated_delta_rule.h"

namespace deltamoe::gdn_cuda {

constexpr int kChunk = kGatedDeltaRuleChunkSize;  // 64 tokens
constexpr int kThreads = 256;                     // threads of every block
constexpr int kScanColumns = 16;  // state columns one scan block carries (more blocks in flight)

// One chunk: tokens [t0, t0 + len) of sequence `seq`.
struct ChunkInfo {
  int t0;
  int len;
  int seq;
  int pad;
};

// Upper bound of the chunk count: every sequence adds at most one partial chunk.
inline int64_t max_chunks(const GatedDeltaRuleShape& s) {
  return s.num_tokens / kChunk + s.num_seqs;
}

// Device pointers into the caller's workspace. Token-indexed arrays follow the [T, Hv, ...]
// layout; chunk-indexed ones are [max_chunks, Hv, ...] by the chunk's index in the table.
struct Workspace {
  ChunkInfo* chunks;     // [max_chunks]
  int* chunk_count;      // [1] chunks actually used
  int* chunk_offsets;    // [N+1] first chunk of each sequence
  float* gamma;          // [T, Hv] cumulative log decay inside the chunk
  float* w;              // [T, Hv, Dk] W = A diag(beta e^gamma) K; backward overwrites with dW
  float* v_new;          // [T, Hv, Dv] U, then V_new = U - W H in place
  float* p;              // [C, Hv, 64, 64] (scale q_i . k_j) e^(gamma_i - gamma_j), j <= i
  float* a_inv;          // [C, Hv, 64, 64] A = (I + L)^-1
  float* h;              // [C, Hv, Dk, Dv] state entering each chunk
  // Backward only (null in the forward layout):
  float* dh;             // [C, Hv, Dk, Dv] dL/d(state leaving each chunk)
  float* dv_new;         // [T, Hv, Dv]
  float* dq_acc;         // [T, Hv, Dk] per value head, fp32
  float* dk_acc;         // [T, Hv, Dk]
  float* dgamma;         // [T, Hv] partial d gamma from the state terms
};

// Carves the workspace (base may be null to measure); returns the bytes needed.
size_t carve_workspace(const GatedDeltaRuleShape& shape, bool backward, void* base,
                       Workspace* out);

void check_shape(const char* op, const GatedDeltaRuleShape& shape);

// Stages both directions run, in this order on one stream.
void launch_build_chunk_table(const GatedDeltaRuleShape& shape, const Workspace& ws,
                              cudaStream_t stream);
void launch_prepare_chunks(const GatedDeltaRuleShape& shape, float scale, const __nv_bfloat16* q,
                           const __nv_bfloat16* k, const __nv_bfloat16* v, const float* g,
                           const float* beta, const Workspace& ws, cudaStream_t stream);
void launch_state_scan(const GatedDeltaRuleShape& shape, const __nv_bfloat16* k,
                       const float* initial_state, float* final_state, const Workspace& ws,
                       cudaStream_t stream);

// Block-wide helpers.
__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ inline int key_head_of(const GatedDeltaRuleShape& s, int h) {
  return h / (s.num_value_heads / s.num_key_heads);
}

}  // namespace deltamoe::gdn_cuda
