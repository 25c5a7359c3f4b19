// Fused attention forward and backward through cuDNN's SDPA (the cuDNN 9 backend graph API, no
// frontend library): softmax(scale * Q K^T) V over packed sequences, causal (top-left, per
// sequence) or not, grouped-query heads, bf16 in/out, fp32 softmax statistics. The same maths as
// flash_attention_cuda.h (specs: attention_ref.cc, bidirectional_attention_ref.cc); that kernel
// stays the fallback and the sm_80 path.
//
// Packing: the tensors are our [T, H, D] rows; each sequence is a "ragged" batch entry whose
// element offset (cu_seqlens[i] * H * D) and length cuDNN reads from device arrays that
// forward()/backward() derive from cu_seqlens on the stream. So one pair of plans, built at setup
// for the run's maximum tokens and sequences per micro-batch, serves every packing: nothing is
// compiled, autotuned or keyed on sequence lengths inside a step. Unused batch entries (fewer
// sequences than the maximum) get length 0, but each is still a batch entry of cuDNN's grid: a plan
// for 1,024 sequences ran a 2 x 4,096 packing 26% slower than one for 2, and 8 sequences 60% slower
// (H100; a plan for 64 costs 0.5-2.5%). So where the maximum passes kCudnnNarrowSegments a second
// pair of plans is built for that many, and a call whose sequences fit it takes that pair.
//
// The graphs are the composite ones cuDNN's runtime-fusion engine matches to its flash kernels
// (the same nodes, in the same order, as cudnn-frontend's SDPA node; see cudnn_sdpa.cc).
// Statistics: lse [T, Hq] fp32 = max + log(sum exp), natural log, the layout and meaning of our
// kernel's lse, so the saved activation is unchanged.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace deltamoe {

// The sequence capacity of the narrower plans a CudnnSdpa for more sequences also builds.
constexpr int64_t kCudnnNarrowSegments = 64;

// The shortest per-sequence row capacity of the plans `CudnnSdpaConfig::sequence_plans` adds (then
// twice that, and so on below max_tokens).
constexpr int64_t kCudnnShortestSequencePlan = 1024;

struct CudnnSdpaConfig {
  int64_t max_tokens = 0;    // T: rows of q/k/v per call (cu_seqlens[n] <= T)
  int64_t max_segments = 0;  // N: sequences per call (n <= N)
  int64_t num_q_heads = 0;   // Hq
  int64_t num_kv_heads = 0;  // Hkv, divides Hq
  int64_t head_dim = 0;      // D of q and k: a multiple of 16, <= 256
  int64_t value_dim = 0;     // Dv of v and out: 0 (= D) or a multiple of 8, <= 256
  bool causal = true;        // top-left causal within each sequence, else the whole sequence
  float scale = 0;           // usually D^-0.5 (of the unpadded D where q and k are zero-padded)
  // S, the rows of one batch entry: the longest sequence a call may hold (0: max_tokens). cuDNN's
  // grids cover S rows of every entry whatever its length (its dO.O row sums launch S / 8 x N x Hq
  // blocks), so a plan whose S is the longest sequence rather than the whole micro-batch runs
  // packings of many short sequences (a batch of images) with fewer empty blocks and tiles.
  int64_t max_sequence_tokens = 0;
  // Also build plans for S = kCudnnShortestSequencePlan, twice that, ... below the plan's S; a call
  // that names its longest sequence takes the smallest that holds it (the vision tower, whose frame
  // lengths the host knows).
  bool sequence_plans = false;
};

class CudnnSdpa {
 public:
  // Builds the forward and backward plans for `config` on the current device, or returns null and
  // says why in *why_not (not the sm_90a kernel path, cuDNN < 9.6, shape outside the fused
  // kernels, no engine for the graph: the message names the graph and node cuDNN refused). Never
  // throws for those.
  static std::unique_ptr<CudnnSdpa> create(const CudnnSdpaConfig& config, std::string* why_not);
  ~CudnnSdpa();
  CudnnSdpa(const CudnnSdpa&) = delete;
  CudnnSdpa& operator=(const CudnnSdpa&) = delete;

  const CudnnSdpaConfig& config() const { return config_; }
  // Device scratch each direction needs (256-byte aligned pointer; the narrower plans' included);
  // constant for the plan.
  size_t forward_workspace_bytes() const;
  size_t backward_workspace_bytes() const;
  // The parts of the backward's workspace known before the plans exist (batch arrays, the fp32
  // row sums and dQ accumulator): backward_workspace_bytes() = this + the plan's own scratch.
  static size_t fixed_workspace_bytes(const CudnnSdpaConfig& config);

  // q [T, Hq, D], k [T, Hkv, D] and v [T, Hkv, Dv] -> out [T, Hq, Dv], lse [T, Hq] fp32, written
  // for the rows of the n sequences. cu_seqlens: DEVICE int32 [n + 1] (validated by the caller), n <= N.
  // longest_sequence: 0, or at least the longest of the n sequences (the host's count: it picks
  // among the sequence plans; a smaller value than the truth drops rows from the attention).
  void forward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, const int32_t* cu_seqlens,
               int64_t num_segments, __nv_bfloat16* out, float* lse, void* workspace, size_t workspace_bytes,
               cudaStream_t stream, int64_t longest_sequence = 0) const;
  // d_out [T, Hq, Dv] -> dq [T, Hq, D], dk [T, Hkv, D] and dv [T, Hkv, Dv], written (dK/dV summed
  // over each KV head's query heads); out and lse are the forward's (ours or cuDNN's: same meaning).
  void backward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* out,
                const float* lse, const __nv_bfloat16* d_out, const int32_t* cu_seqlens, int64_t num_segments,
                __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, void* workspace, size_t workspace_bytes,
                cudaStream_t stream, int64_t longest_sequence = 0) const;

  // The rows per sequence (S) of the plans a call of n sequences, the longest longest_sequence
  // rows (0: not named), runs on.
  int64_t plan_sequence_rows(int64_t num_segments, int64_t longest_sequence) const;

  // Plans built by this process (forward and backward count one each): tests use it to prove
  // that steps with new packings build nothing.
  static int64_t plans_built();

  struct Impl;

 private:
  CudnnSdpa(const CudnnSdpaConfig& config, std::unique_ptr<Impl> impl);
  CudnnSdpaConfig config_;
  std::unique_ptr<Impl> impl_;
  // Plans for kCudnnNarrowSegments sequences where config_ takes more (null otherwise): the calls
  // whose sequences fit go to it.
  std::unique_ptr<CudnnSdpa> narrow_;
  // With config_.sequence_plans: plans for shorter S, shortest first; a call whose longest sequence
  // fits one goes to the first that holds it.
  std::vector<std::unique_ptr<CudnnSdpa>> shorter_;
  // The plans a call of n sequences, the longest longest_sequence rows (0: unknown), runs on.
  const CudnnSdpa& plans_for(int64_t num_segments, int64_t longest_sequence) const;
};

// Writes the cuDNN batch arrays for n of N sequences from cu_seqlens (device, int32 [n + 1]):
// seq_len[N], and for each k the element offsets offsets[k][N + 1] of rows of row_elements[k]
// elements; entries past n get length 0 and the offset of the end. One small kernel.
constexpr int kCudnnSdpaOffsetArrays = 5;  // Q-like, K-like, O-like, V-like rows and the statistics
void cudnn_sdpa_batch_arrays_cuda(const int32_t* cu_seqlens, int64_t num_segments, int64_t max_segments,
                                  const std::array<int64_t, kCudnnSdpaOffsetArrays>& row_elements, int32_t* seq_len,
                                  const std::array<int32_t*, kCudnnSdpaOffsetArrays>& offsets, cudaStream_t stream);

}  // namespace deltamoe
