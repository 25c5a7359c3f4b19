// CUDA forward of the chunked gated delta rule: chunk table, per-chunk UT/WY preparation
// (A = (I + L)^-1, W, U, P), the sequential state scan over chunks (64-column slices of the state
// in parallel), which on Hopper also writes the chunk outputs (an output kernel after it on sm_80);
// the products run on tensor cores (gdn_mma.cuh: bf16 operands, and W's and U's fp32 coefficients
// split in two), the triangular inverse, the running state and the gates in fp32.
#include <algorithm>
#include <cstddef>

#include "core/cuda_check.h"
#include "kernels/common/kernel_path_cuda.h"
#include "kernels/gated_delta_rule/gated_delta_rule_cuda.h"
#include "kernels/gated_delta_rule/gated_delta_rule_internal.cuh"
#include "kernels/gated_delta_rule/gdn_mma.cuh"

namespace deltamoe {
namespace gdn_cuda {
namespace {

// One block: thread 0 counts chunks and state slots (boundaries between two chunks of one
// sequence) per sequence, then all threads fill the table and zero its entries past the count
// (the forward's load_chunk tells a block past the count by its entry's zero length).
__global__ void build_chunk_table_kernel(const int32_t* cu_seqlens, int num_seqs, int max_chunks,
                                         ChunkInfo* chunks, int* chunk_count, int* chunk_offsets,
                                         int* slot_offsets) {
  if (threadIdx.x == 0) {
    int total = 0, slots = 0;
    for (int n = 0; n < num_seqs; ++n) {
      chunk_offsets[n] = total;
      slot_offsets[n] = slots;
      const int count = (cu_seqlens[n + 1] - cu_seqlens[n] + kChunk - 1) / kChunk;
      total += count;
      slots += max(count - 1, 0);
    }
    chunk_offsets[num_seqs] = total;
    slot_offsets[num_seqs] = slots;
    *chunk_count = total;
  }
  __syncthreads();
  for (int c = *chunk_count + static_cast<int>(threadIdx.x); c < max_chunks; c += blockDim.x)
    chunks[c] = ChunkInfo{0, 0, 0, -1, -1};
  for (int n = threadIdx.x; n < num_seqs; n += blockDim.x) {
    const int begin = cu_seqlens[n], end = cu_seqlens[n + 1], first = chunk_offsets[n], slot0 = slot_offsets[n];
    for (int i = 0; begin + i * kChunk < end; ++i) chunks[first + i] = sequence_chunk(begin, end, n, slot0, i);
  }
}

// Shared tiles of the preparation kernel (~71 KB: three blocks per SM on Hopper, two on an A800),
// each region reused once its first content is dead:
//   k   K; then W's bf16 rows on their way out
//   qv  Q; then V, loaded once Q K^T is done (its latency hides behind P's stores and the inverse)
//   l   L, whose finished block rows hold the inverse's inner sums; then A diag(beta e^gamma); then
//       U's bf16 rows on their way out
//   a   P's bf16 rows on their way out; then A = (I + L)^-1; then A diag(beta), in place
struct PrepareSmem {
  __nv_bfloat16 k[kChunk * kBf16Stride];
  __nv_bfloat16 qv[kChunk * kBf16Stride];
  float l[kChunk * kSqStride];
  float a[kChunk * kSqStride];
  float gamma[kChunk], beta[kChunk], exp_gamma[kChunk];
};
static_assert(3 * (sizeof(PrepareSmem) + 1024) <= 228 * 1024 && 2 * (sizeof(PrepareSmem) + 1024) <= 164 * 1024,
              "three preparation blocks per Hopper SM, two per A800 SM");
static_assert(sizeof(PrepareSmem::l) >= sizeof(__nv_bfloat16) * kChunk * kBf16Stride &&
                  sizeof(PrepareSmem::a) >= sizeof(__nv_bfloat16) * kChunk * kSqBf16Stride &&
                  offsetof(PrepareSmem, l) % 16 == 0 && offsetof(PrepareSmem, a) % 16 == 0 &&
                  offsetof(PrepareSmem, qv) % 16 == 0 && (kBf16Stride * sizeof(__nv_bfloat16)) % 16 == 0 &&
                  (kSqStride * sizeof(float)) % 16 == 0 && (kSqBf16Stride * sizeof(__nv_bfloat16)) % 16 == 0,
              "U's bf16 tile fits L's, P's fits A's, and the staged rows are read 16 bytes at a time");
// Blocks per SM the preparation's registers allow for: three where the shared tiles fit three.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kPrepareBlocksPerSm = 2;
#else
constexpr int kPrepareBlocksPerSm = 3;
#endif

// Block row kBi of the inverse below the diagonal, once blocks rows < kBi and the diagonal block
// kBi are done: A_{kBi,bj} = -A_{kBi,kBi} sum_{bj <= m < kBi} L_{kBi,m} A_{m,bj} for bj < kBi, the
// inner sums through `scratch` (which may lie in l's earlier block rows: every sum is formed before
// any is written). Thread t takes entry (t / 16, t % 16) of each block bj, so block and trip counts
// are known at compile time: the loops unroll and their shared loads issue ahead of the sums; each
// sum still adds its terms in order of m, as written.
template <int kBi>
__device__ __forceinline__ void sweep_block_row(const float* l, float* a, float* scratch) {
  constexpr int S = kSqStride;
  static_assert(kThreads == 256, "one thread per entry of a 16 x 16 block");
  const int r = static_cast<int>(threadIdx.x) / 16, c = static_cast<int>(threadIdx.x) % 16;
  float sums[kBi];
#pragma unroll
  for (int bj = 0; bj < kBi; ++bj) {
    float sum = 0.0f;
#pragma unroll
    for (int m = 16 * bj; m < 16 * kBi; ++m) sum += l[(16 * kBi + r) * S + m] * a[m * S + 16 * bj + c];
    sums[bj] = sum;
  }
#pragma unroll
  for (int bj = 0; bj < kBi; ++bj) scratch[r * S + 16 * bj + c] = sums[bj];
  __syncthreads();
#pragma unroll
  for (int bj = 0; bj < kBi; ++bj) {
    float sum = 0.0f;
#pragma unroll
    for (int m = 0; m < 16; ++m)
      if (m <= r) sum += a[(16 * kBi + r) * S + 16 * kBi + m] * scratch[m * S + 16 * bj + c];
    a[(16 * kBi + r) * S + 16 * bj + c] = -sum;
  }
  __syncthreads();
}

// a = (I + L)^-1 for a strictly lower triangular 64 x 64 L, in fp32: the four 16 x 16 diagonal
// blocks by forward substitution (one warp each), then the block rows below them in turn,
// A_ij = -A_ii sum_{j <= m < i} L_im A_mj. Block row i's inner sums go into L's block row i - 1,
// which nothing reads once block row i - 1 is done (each sweep reads L's rows of its own block row).
__device__ void invert_unit_lower(float* l, float* a) {
  constexpr int S = kSqStride;
  static_assert(kThreads == 256 && kChunk == 64, "one thread per entry of a 16 x 16 block, 4 x 4 blocks");
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  {
    // The six blocks above the diagonal are zeros: entry (tid / 16, tid % 16) of each, block
    // places known at compile time (no division or bounds test per element).
    const int r = tid / 16, c = tid % 16;
#pragma unroll
    for (int bi = 0; bi < 3; ++bi)
#pragma unroll
      for (int bj = bi + 1; bj < 4; ++bj) a[(16 * bi + r) * S + 16 * bj + c] = 0.0f;
  }
  if (warp < 4) {
    // Lane c keeps column c of the block in registers (zeros above the diagonal), so row r is
    // a register dot product with the broadcast row r of L.
    const int b0 = 16 * warp, c = lane & 15;
    float column[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float sum = 0.0f;
#pragma unroll
      for (int m = 0; m < r; ++m) sum += l[(b0 + r) * S + b0 + m] * column[m];
      column[r] = r == c ? 1.0f : (r > c ? -sum : 0.0f);
    }
    if (lane < 16) {
#pragma unroll
      for (int r = 0; r < 16; ++r) a[(b0 + r) * S + b0 + c] = column[r];
    }
  }
  __syncthreads();
  sweep_block_row<1>(l, a, l + 0 * 16 * S);
  sweep_block_row<2>(l, a, l + 1 * 16 * S);
  sweep_block_row<3>(l, a, l + 2 * 16 * S);
}

// Grid (max_chunks, Hv). Builds gamma, P = (scale q_i . k_j) e^(gamma_i - gamma_j) (j <= i),
// A = (I + L)^-1 with L_ij = beta_i (k_i . k_j) e^(gamma_i - gamma_j) (j < i), W = A diag(beta
// e^gamma) K and U = A diag(beta) V of one chunk and head. K K^T and Q K^T run on tensor cores
// with exact bf16 operands; the inverse is fp32 FMA; W and U split A into two bf16 parts. P, A, W
// and U are stored in bf16, the form the later products take them in.
__global__ void __launch_bounds__(kThreads, kPrepareBlocksPerSm)
    prepare_chunks_kernel(GatedDeltaRuleShape s, float scale, const __nv_bfloat16* q,
                          const __nv_bfloat16* k, const __nv_bfloat16* v, const float* g,
                          const float* beta, Workspace ws) {
  const int chunk = blockIdx.x, h = blockIdx.y;
  ChunkInfo ci;
  if (!load_chunk(ws, chunk, &ci)) return;
  const int Dk = s.key_dim, Dv = s.value_dim, Hk = s.num_key_heads, Hv = s.num_value_heads;
  const int kh = key_head_of(s, h), len = ci.len, tid = threadIdx.x, warp = tid >> 5;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  PrepareSmem& sm = *reinterpret_cast<PrepareSmem*>(smem_raw);

  const int64_t qk_first = (static_cast<int64_t>(ci.t0) * Hk + kh) * Dk;
  const int64_t row_first = static_cast<int64_t>(ci.t0) * Hv + h;  // [T, Hv] index of token t0
  load_tile(sm.k, kBf16Stride, kChunk, kD, k + qk_first, static_cast<int64_t>(Hk) * Dk, len, Dk);
  load_tile(sm.qv, kBf16Stride, kChunk, kD, q + qk_first, static_cast<int64_t>(Hk) * Dk, len, Dk);
  if (warp == 0)
    load_chunk_gates(g, beta, row_first, Hv, len, sm.gamma, sm.beta, sm.exp_gamma, ws.gamma);
  wait_tile_loads();
  __syncthreads();

  // P and A are stored by rows at their tokens ([T, Hv, 64]): rows past len are not stored. P's
  // bf16 rows gather in A's tile (free until the inverse) on their way out.
  const int64_t square_first = row_first * kChunk, square_row = static_cast<int64_t>(Hv) * kChunk;
  __nv_bfloat16* const p_tile = reinterpret_cast<__nv_bfloat16*>(sm.a);
  {
    // Warp tile: rows 16 (warp % 4), columns 32 (warp / 4) of the 64 x 64 products.
    const int m0 = 16 * (warp & 3), n0 = 32 * (warp >> 2);
    float kk[1][4][4], qk[1][4][4];
    zero_acc(kk);
    zero_acc(qk);
    warp_mma<1, 4, kD, kD / 16>(kk, rows_of<kBf16Stride>(sm.k), m0, transposed<kBf16Stride>(sm.k), n0);
    warp_mma<1, 4, kD, kD / 16>(qk, rows_of<kBf16Stride>(sm.qv), m0, transposed<kBf16Stride>(sm.k), n0);
    for_each_acc<1, 4>(m0, n0, [&](int mt, int nt, int r, int i, int j) {
      float l_value = 0.0f, p_value = 0.0f;
      if (i < len && j <= i) {
        const float decay = expf(sm.gamma[i] - sm.gamma[j]);
        if (j < i) l_value = sm.beta[i] * kk[mt][nt][r] * decay;
        p_value = scale * qk[mt][nt][r] * decay;
      }
      sm.l[i * kSqStride + j] = l_value;
      p_tile[i * kSqBf16Stride + j] = __float2bfloat16(p_value);
    });
  }
  __syncthreads();
  // Q is done: V takes its tile, in flight through P's stores and the inverse.
  load_tile(sm.qv, kBf16Stride, kChunk, kD, v + row_first * Dv, static_cast<int64_t>(Hv) * Dv, len, Dv);
  // P leaves in 16-byte row pieces, rows past len not stored.
  for (int idx = tid; idx < len * (kChunk / 8); idx += kThreads) {
    const int i = idx / (kChunk / 8), j0 = 8 * (idx % (kChunk / 8));
    *reinterpret_cast<uint4*>(ws.p + square_first + i * square_row + j0) =
        *reinterpret_cast<const uint4*>(&p_tile[i * kSqBf16Stride + j0]);
  }
  __syncthreads();  // P's tile is read: the inverse may write A's
  invert_unit_lower(sm.l, sm.a);
  // A leaves in 16-byte row pieces (8 columns a thread); A diag(beta e^gamma) takes L's place and
  // A diag(beta) A's (each thread rewrites the elements it read), for the W and U products.
  __nv_bfloat16* a_out = ws.a_inv + square_first;
  for (int idx = tid; idx < kChunk * kChunk / 8; idx += kThreads) {
    const int i = idx / (kChunk / 8), j0 = 8 * (idx % (kChunk / 8));
    const float4 lo = *reinterpret_cast<const float4*>(&sm.a[i * kSqStride + j0]);
    const float4 hi = *reinterpret_cast<const float4*>(&sm.a[i * kSqStride + j0 + 4]);
    const float a[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    uint32_t a_bf16[4];  // bf16 pairs, so that the row piece leaves as one 16-byte store
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int j = j0 + u;
      sm.l[i * kSqStride + j] = a[u] * sm.beta[j] * sm.exp_gamma[j];
      sm.a[i * kSqStride + j] = a[u] * sm.beta[j];
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const __nv_bfloat162 pair = __halves2bfloat162(__float2bfloat16(a[2 * u]), __float2bfloat16(a[2 * u + 1]));
      a_bf16[u] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    if (i < len)
      *reinterpret_cast<uint4*>(a_out + i * square_row + j0) = make_uint4(a_bf16[0], a_bf16[1], a_bf16[2], a_bf16[3]);
  }
  wait_tile_loads();  // this thread's copies of V
  __syncthreads();    // everybody's, and the coefficients
  // W and U: 64 x 128 each; warp tile rows 16 (warp % 4), columns 64 (warp / 4). Their bf16 values
  // go through tiles nothing reads any more (W through K's once every warp is done with it, U through
  // L's once the W product is) and leave as 16-byte row pieces, rows past len not stored: a thread's
  // fragment alone would store 64 scattered 2-byte values a matrix. A head dim that is not a
  // multiple of 8 stores them one by one.
  const bool staged = Dk % 8 == 0 && Dv % 8 == 0;
  __nv_bfloat16* const w_tile = sm.k;
  __nv_bfloat16* const u_tile = reinterpret_cast<__nv_bfloat16*>(sm.l);
  const int m0 = 16 * (warp & 3), n0 = 64 * (warp >> 2);
  float acc[1][8][4];
  const auto put = [&](const float (&values)[1][8][4], __nv_bfloat16* tile, __nv_bfloat16* out, int dim) {
    for_each_acc<1, 8>(m0, n0, [&](int mt, int nt, int r, int i, int d) {
      const __nv_bfloat16 value = __float2bfloat16(values[mt][nt][r]);
      if (staged)
        tile[i * kBf16Stride + d] = value;
      else if (i < len && d < dim)
        out[(row_first + static_cast<int64_t>(i) * Hv) * dim + d] = value;
    });
  };
  zero_acc(acc);
  warp_mma<1, 8, kChunk>(acc, rows_of<kSqStride>(sm.l), m0, rows_of<kBf16Stride>(sm.k), n0);
  __syncthreads();  // K and A diag(beta e^gamma) are read
  put(acc, w_tile, ws.w, Dk);
  zero_acc(acc);
  warp_mma<1, 8, kChunk>(acc, rows_of<kSqStride>(sm.a), m0, rows_of<kBf16Stride>(sm.qv), n0);
  put(acc, u_tile, ws.v_new, Dv);
  if (!staged) return;
  __syncthreads();
  const auto copy_out = [&](const __nv_bfloat16* tile, __nv_bfloat16* out, int dim) {
    for (int idx = tid; idx < len * (dim / 8); idx += kThreads) {
      const int i = idx / (dim / 8), c = 8 * (idx % (dim / 8));
      *reinterpret_cast<uint4*>(out + (row_first + static_cast<int64_t>(i) * Hv) * dim + c) =
          *reinterpret_cast<const uint4*>(tile + i * kBf16Stride + c);
    }
  };
  copy_out(w_tile, ws.w, Dk);
  copy_out(u_tile, ws.v_new, Dv);
}

// State columns one forward-scan block carries. Every block of a head pulls the chunk's W and K,
// so the scan's L2 traffic falls with the number of column blocks: with 32 columns (4 blocks a
// head) the scan ran at 71% of L2 throughput on an H100. 64 columns (2 blocks a head) halve that
// traffic and double each block's share of the (small) products of a step.
constexpr int kStateScanCols = 64;

// Shared tiles of the forward state scan carrying kStateScanCols state columns. The running fp32
// state lives in registers (the state update's accumulators); shared memory holds its bf16 copy
// (the operand of V_new = U - W H and the stored slot), V_new scaled for the update, V_new on its
// way out, and a ring of kStages chunks' inputs. With two stages (~125 KB, one block per SM on
// Hopper) chunk i + 1's K and chunk i + 2's W, U and gamma are in flight while chunk i runs, so a
// step does not wait on a load's latency; one stage (~81 KB) keeps two blocks per SM within sm_80's
// 164 KB, and each half of a step then covers the other half's loads.
constexpr int kScanBf16Cols = kStateScanCols + 8;  // row stride of the scan's bf16 column slices

template <int kStages>
struct ScanSmem {
  static constexpr int kBf16Cols = kScanBf16Cols;
  struct Inputs {                                       // one chunk's
    alignas(16) __nv_bfloat16 w[kChunk * kBf16Stride];  // W
    alignas(16) __nv_bfloat16 k[kChunk * kBf16Stride];  // K of the key head
    alignas(16) __nv_bfloat16 u[kChunk * kBf16Cols];    // U, the block's columns
    alignas(16) float gamma[kChunk];
  };
  alignas(16) __nv_bfloat16 hb[kD * kBf16Cols];          // state columns [col0, col0 + kStateScanCols), bf16
  alignas(16) __nv_bfloat16 vn[kChunk * kBf16Cols];      // e^(gamma_last - gamma_j) V_new_j
  alignas(16) __nv_bfloat16 v_out[kChunk * kBf16Cols];   // V_new (bf16, as stored), on its way out in 16-byte row pieces
  Inputs in[kStages];
};
// Each block with the 1 KB the driver reserves: two one-stage blocks per SM within sm_80's 164 KB; on
// Hopper a two-stage block (~125 KB at 64 columns) is alone on its SM, which a step of 64 columns fills.
static_assert(2 * (sizeof(ScanSmem<1>) + 1024) <= 164 * 1024 && sizeof(ScanSmem<2>) + 1024 <= 228 * 1024,
              "two one-stage scan blocks per SM on sm_80, a two-stage one on Hopper");

// What a scan that also writes the chunk outputs holds beyond ScanSmem (placed after it): each
// stage's Q and P, and o on its way out. The output's products read the state's bf16 copy and V_new
// as the scan has them in shared memory, so o costs no second pass over the H slots and V_new.
// On Hopper the two-stage block with them (~187 KB) is still one an SM; on sm_80 a one-stage block
// would grow to ~117 KB, one an SM, which on an A800's 108 SMs runs 2 x 32 heads x 2 column blocks
// in two waves: that path keeps the separate output kernel.
template <int kStages>
struct ScanOutputSmem {
  struct Inputs {
    alignas(16) __nv_bfloat16 q[kChunk * kBf16Stride];    // Q of the key head
    alignas(16) __nv_bfloat16 p[kChunk * kSqBf16Stride];  // P
  };
  alignas(16) __nv_bfloat16 o[kChunk * kScanBf16Cols];    // o, the block's columns
  Inputs in[kStages];
};
static_assert(sizeof(ScanSmem<2>) + sizeof(ScanOutputSmem<2>) + 1024 <= 228 * 1024 &&
                  sizeof(ScanSmem<2>) % 16 == 0,
              "a two-stage scan with the outputs fits one Hopper SM, its output tiles on 16 bytes");

// The output a scan writes as it goes (o null: none; the backward's recompute of the scan).
struct ScanOutput {
  float scale = 0.0f;
  const __nv_bfloat16* q = nullptr;
  __nv_bfloat16* o = nullptr;
};

// Starts the asynchronous copies of one chunk's V_new inputs (W, U, gamma); the caller commits.
template <typename Inputs>
__device__ void issue_vnew_inputs(Inputs& in, const GatedDeltaRuleShape& s, const Workspace& ws,
                                  const ChunkInfo& ci, int h, int col0, int cols) {
  const int Dk = s.key_dim, Dv = s.value_dim, Hv = s.num_value_heads;
  const int64_t row_first = static_cast<int64_t>(ci.t0) * Hv + h;
  load_tile(in.w, kBf16Stride, kChunk, kD, ws.w + row_first * Dk, static_cast<int64_t>(Hv) * Dk,
            ci.len, Dk);
  load_tile(in.u, kScanBf16Cols, kChunk, kStateScanCols, ws.v_new + row_first * Dv + col0,
            static_cast<int64_t>(Hv) * Dv, ci.len, cols);
  for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
    const bool valid = i < ci.len;
    cp_async_4(&in.gamma[i], ws.gamma + (valid ? row_first + static_cast<int64_t>(i) * Hv : 0),
               valid);
  }
}

// Starts the copy of one chunk's state-update input (K); the caller commits.
template <typename Inputs>
__device__ void issue_state_input(Inputs& in, const GatedDeltaRuleShape& s,
                                  const __nv_bfloat16* k, const ChunkInfo& ci, int h) {
  const int Dk = s.key_dim, Hk = s.num_key_heads;
  load_tile(in.k, kBf16Stride, kChunk, kD,
            k + (static_cast<int64_t>(ci.t0) * Hk + key_head_of(s, h)) * Dk,
            static_cast<int64_t>(Hk) * Dk, ci.len, Dk);
}

// Grid (N, Hv, ceil(Dv / kStateScanCols)). Carries kStateScanCols columns of one head's state
// through the chunks of one sequence (state columns evolve independently): stores the state
// entering each chunk that has a slot (all but the sequence's first, in bf16), turns U into
// V_new = U - W H and advances H <- e^gamma_last H + K^T diag(e^(gamma_last - gamma)) V_new.
// The chunks' places come from cu_seqlens as the table's builder computes them (sequence_chunk),
// so no step waits on a table read before it can address the next inputs.
// kOutput: also o_i = e^gamma_i (scale q_i)^T H + sum_{j<=i} P_ij v_new_j for the block's columns,
// the output kernel's products on the same bf16 operands in the same order (the same bits). Q H
// runs beside W H and P V_new beside the state update: neither is on the chain from one chunk's
// state to the next, so they fill the steps' latency. Q goes with W, U, gamma and P with K (P is
// read after the step's second barrier, when the stage's W slot already takes chunk c + kStages).
template <int kStages, bool kOutput>
__global__ void __launch_bounds__(kThreads, 2)
    state_scan_kernel(GatedDeltaRuleShape s, const __nv_bfloat16* k, const float* initial_state,
                      float* final_state, Workspace ws, ScanOutput out) {
  using Smem = ScanSmem<kStages>;
  using OutSmem = ScanOutputSmem<kStages>;
  constexpr int kCols = kStateScanCols, kBf16Cols = Smem::kBf16Cols;
  const int n = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * kCols;
  const int Dk = s.key_dim, Dv = s.value_dim, Hk = s.num_key_heads, Hv = s.num_value_heads;
  const int tid = threadIdx.x, warp = tid >> 5;
  const int cols = min(kCols, Dv - col0);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  OutSmem& osm = *reinterpret_cast<OutSmem*>(smem_raw + sizeof(Smem));  // kOutput only
  const int64_t state_base = (static_cast<int64_t>(n) * Hv + h) * Dk * Dv + col0;
  const int begin = s.cu_seqlens[n], end = s.cu_seqlens[n + 1], slot0 = ws.slot_offsets[n];
  const int chunks = (end - begin + kChunk - 1) / kChunk;
  const int64_t qk_head = static_cast<int64_t>(key_head_of(s, h)) * Dk;
  // Every issue commits one group, empty past the sequence's last chunk, so each wait below counts
  // the same younger groups: W, U, gamma (and Q) of chunk i are issued kStages chunks ahead (before
  // the loop, or in step i - kStages once chunk i - kStages is done with them), K (and P) of chunk i
  // at the top of step i - kStages + 1.
  const auto issue_vnew = [&](int i) {
    if (i < chunks) {
      const ChunkInfo ci = sequence_chunk(begin, end, n, slot0, i);
      issue_vnew_inputs(sm.in[i % kStages], s, ws, ci, h, col0, cols);
      if constexpr (kOutput)
        load_tile(osm.in[i % kStages].q, kBf16Stride, kChunk, kD, out.q + static_cast<int64_t>(ci.t0) * Hk * Dk + qk_head,
                  static_cast<int64_t>(Hk) * Dk, ci.len, Dk);
    }
    cp_async_commit();
  };
  const auto issue_k = [&](int i) {
    if (i < chunks) {
      const ChunkInfo ci = sequence_chunk(begin, end, n, slot0, i);
      issue_state_input(sm.in[i % kStages], s, k, ci, h);
      if constexpr (kOutput)
        load_tile(osm.in[i % kStages].p, kSqBf16Stride, kChunk, kChunk,
                  ws.p + (static_cast<int64_t>(ci.t0) * Hv + h) * kChunk, static_cast<int64_t>(Hv) * kChunk, ci.len,
                  kChunk);
    }
    cp_async_commit();
  };
  for (int i = 0; i < kStages; ++i) {
    issue_vnew(i);
    if (i + 1 < kStages) issue_k(i);
  }
  // The state: the update's accumulator tile of this warp, rows 16 warp, all kCols columns.
  constexpr int kStateNT = kCols / 8;
  const int state_m0 = 16 * warp;
  RunningState<kCols> state;
  load_running_state<kCols>(state, initial_state == nullptr ? nullptr : initial_state + state_base, s, cols, sm.hb,
                            kBf16Cols);
  // V_new and o leave through shared tiles in 16-byte row pieces: a fragment alone would store
  // scattered 2-byte values. A value dim that is not a multiple of 8 (or an o not on 16 bytes)
  // stores them one by one.
  const bool staged = Dv % 8 == 0;
  const bool o_staged = staged && (reinterpret_cast<uintptr_t>(out.o) & 15) == 0;
  // o of chunk c leaves at the top of step c + 1 (after its first barrier) or after the loop.
  const auto store_o = [&](int c) {
    const ChunkInfo ci = sequence_chunk(begin, end, n, slot0, c);
    const int64_t row_first = static_cast<int64_t>(ci.t0) * Hv + h;
    copy_tile_rows<kCols, kBf16Cols, kThreads>(out.o + row_first * Dv + col0, static_cast<int64_t>(Hv) * Dv, osm.o,
                                               ci.len, cols);
  };
  // The V_new and o warp tile: rows 16 (warp % 4), columns kCols / 2 (warp / 4).
  constexpr int kNT = kCols / 16;
  const int m0 = 16 * (warp & 3), n0 = (kCols / 2) * (warp >> 2);
  for (int c = 0; c < chunks; ++c) {
    const ChunkInfo ci = sequence_chunk(begin, end, n, slot0, c);
    const int len = ci.len;
    const int64_t row_first = static_cast<int64_t>(ci.t0) * Hv + h;
    auto& in = sm.in[c % kStages];
    cp_async_wait<2 * (kStages - 1)>();  // chunk c's W, U, gamma (younger: K of c .. c + kStages - 2, W of .. c + kStages - 1)
    __syncthreads();  // ... are in; everybody is done with chunk c - 1 (its K, V_new, o and the state's bf16 copy)
    if constexpr (kOutput) {
      if (o_staged && c > 0) store_o(c - 1);
    }
    issue_k(c + kStages - 1);
    // (A chunk that begins its sequence enters with its initial state: nothing to store.)
    if (ci.h_slot >= 0)
      store_state_slice<kCols>(ws.h + (static_cast<int64_t>(ci.h_slot) * Hv + h) * Dk * Dv + col0, sm.hb, kBf16Cols,
                               s, cols);
    const float g_last = in.gamma[len - 1];
    float o_acc[1][kNT][4];
    {
      // V_new = U - W H: 64 x kCols.
      float acc[1][kNT][4];
      zero_acc(acc);
      warp_mma<1, kNT, kD>(acc, rows_of<kBf16Stride>(in.w), m0, rows_of<kBf16Cols>(sm.hb), n0);
      if constexpr (kOutput) {
        zero_acc(o_acc);
        warp_mma<1, kNT, kD, kD / 16>(o_acc, rows_of<kBf16Stride>(osm.in[c % kStages].q), m0,
                                      rows_of<kBf16Cols>(sm.hb), n0);
      }
      // This lane's rows are m0 + g and m0 + g + 8: their decays once, not per element.
      const int row0 = m0 + ((tid & 31) >> 2);
      if constexpr (kOutput) {
        const float o_gate[2] = {row0 < len ? expf(in.gamma[row0]) : 0.0f,
                                 row0 + 8 < len ? expf(in.gamma[row0 + 8]) : 0.0f};
        for_each_acc<1, kNT>(m0, n0, [&](int mt, int nt, int r, int, int) { o_acc[mt][nt][r] *= out.scale * o_gate[r >> 1]; });
      }
      const float decay[2] = {row0 < len ? expf(g_last - in.gamma[row0]) : 0.0f,
                              row0 + 8 < len ? expf(g_last - in.gamma[row0 + 8]) : 0.0f};
      // A fragment's column pairs read U and write V_new and its decayed copy 4 bytes at a time.
      for_each_acc_pair<1, kNT>(m0, n0, [&](int mt, int nt, int half, int i, int e) {
        const float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&in.u[i * kBf16Cols + e]));
        const float value0 = u.x - acc[mt][nt][2 * half], value1 = u.y - acc[mt][nt][2 * half + 1];
        const __nv_bfloat162 stored = __floats2bfloat162_rn(value0, value1);
        *reinterpret_cast<__nv_bfloat162*>(&sm.v_out[i * kBf16Cols + e]) = stored;
        if (!staged && i < len) {
          __nv_bfloat16* row = ws.v_new + (row_first + static_cast<int64_t>(i) * Hv) * Dv + col0;
          if (e < cols) row[e] = stored.x;
          if (e + 1 < cols) row[e + 1] = stored.y;
        }
        *reinterpret_cast<__nv_bfloat162*>(&sm.vn[i * kBf16Cols + e]) =
            __floats2bfloat162_rn(decay[half] * value0, decay[half] * value1);
      });
    }
    if constexpr (kStages == 1) {
      __syncthreads();  // W, U, gamma (and Q) are free: chunk c + 1's fly during the state half
      issue_vnew(c + 1);
      cp_async_wait<1>();  // K (and P) of chunk c (younger: W of c + 1)
    } else {
      cp_async_wait<2 * kStages - 2>();  // K (and P) of chunk c (younger: W of c + 1 .. , K of c + 1 ..)
    }
    __syncthreads();  // V_new is complete, K is in; W, U, gamma of chunk c are free
    if constexpr (kStages > 1) issue_vnew(c + kStages);
    if (staged)
      copy_tile_rows<kCols, kBf16Cols, kThreads>(ws.v_new + row_first * Dv + col0, static_cast<int64_t>(Hv) * Dv,
                                                 sm.v_out, len, cols);
    {
      // H <- e^gamma_last H + K^T (decayed V_new), in this warp's registers; then its bf16 copy.
      const float chunk_decay = expf(g_last);
      float acc[1][kStateNT][4];
      for_each_acc<1, kStateNT>(state_m0, 0, [&](int mt, int nt, int r, int, int) {
        acc[mt][nt][r] = chunk_decay * state[mt][nt][r];
      });
      warp_mma<1, kStateNT, kChunk>(acc, transposed<kBf16Stride>(in.k), state_m0, rows_of<kBf16Cols>(sm.vn), 0);
      for_each_acc_pair<1, kStateNT>(state_m0, 0, [&](int mt, int nt, int half, int d, int e) {
        state[mt][nt][2 * half] = acc[mt][nt][2 * half];
        state[mt][nt][2 * half + 1] = acc[mt][nt][2 * half + 1];
        *reinterpret_cast<__nv_bfloat162*>(&sm.hb[d * kBf16Cols + e]) =
            __floats2bfloat162_rn(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
      });
    }
    if constexpr (kOutput) {
      // o += P V_new (V_new as stored in bf16); it leaves at the top of the next step.
      warp_mma<1, kNT, kChunk, kChunk / 16>(o_acc, rows_of<kSqBf16Stride>(osm.in[c % kStages].p), m0,
                                            rows_of<kBf16Cols>(sm.v_out), n0);
      if (o_staged) {
        store_acc_bf16_pairs<1, kNT, kBf16Cols>(o_acc, osm.o, m0, n0);
      } else {
        for_each_acc<1, kNT>(m0, n0, [&](int mt, int nt, int r, int i, int e) {
          if (i < len && e < cols)
            out.o[(row_first + static_cast<int64_t>(i) * Hv) * Dv + col0 + e] = __float2bfloat16(o_acc[mt][nt][r]);
        });
      }
    }
  }
  if constexpr (kOutput) {
    if (o_staged && chunks > 0) {
      __syncthreads();
      store_o(chunks - 1);
    }
  }
  if (final_state != nullptr) store_running_state<kCols>(state, final_state + state_base, s, cols);
}

// Shared tiles of the output kernel (~54 KB).
struct OutputSmem {
  alignas(16) __nv_bfloat16 q[kChunk * kBf16Stride];
  alignas(16) __nv_bfloat16 h[kD * kColBf16Stride];      // state entering the chunk, columns [col0, col0 + 64)
  alignas(16) __nv_bfloat16 p[kChunk * kSqBf16Stride];
  alignas(16) __nv_bfloat16 vn[kChunk * kColBf16Stride];  // V_new, same columns
  alignas(16) float exp_gamma[kChunk];
};
static_assert(sizeof(OutputSmem) <= kSm80MaxSharedBytesPerBlock, "the shared tiles must fit sm_80's 163 KB");

// Grid (max_chunks, Hv, ceil(Dv / 64)): o_i = e^gamma_i (scale q_i)^T H + sum_{j<=i} P_ij v_new_j
// for the block's 64 columns; H is the chunk's slot or, for a sequence's first chunk, its initial
// state. Chunks run fastest: numbering the column blocks of a (chunk, head) next to each other, to
// read q and P from L2 the second time, measured slower on an H100 (0.161 -> 0.182 ms).
__global__ void __launch_bounds__(kThreads, 2)
    output_kernel(GatedDeltaRuleShape s, float scale, const __nv_bfloat16* q,
                  const float* initial_state, Workspace ws, __nv_bfloat16* o) {
  const int chunk = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * kScanCols;
  ChunkInfo ci;
  if (!load_chunk(ws, chunk, &ci)) return;
  const int Dk = s.key_dim, Dv = s.value_dim, Hk = s.num_key_heads, Hv = s.num_value_heads;
  const int kh = key_head_of(s, h), len = ci.len, tid = threadIdx.x, warp = tid >> 5;
  const int cols = min(kScanCols, Dv - col0);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  OutputSmem& sm = *reinterpret_cast<OutputSmem*>(smem_raw);
  const int64_t row_first = static_cast<int64_t>(ci.t0) * Hv + h;
  load_tile(sm.q, kBf16Stride, kChunk, kD, q + (static_cast<int64_t>(ci.t0) * Hk + kh) * Dk,
            static_cast<int64_t>(Hk) * Dk, len, Dk);
  load_state_tile(sm.h, kColBf16Stride, kScanCols, entering_state(s, ws, ci, initial_state, h), s, col0, cols);
  load_tile(sm.p, kSqBf16Stride, kChunk, kChunk, ws.p + row_first * kChunk,
            static_cast<int64_t>(Hv) * kChunk, len, kChunk);
  load_tile(sm.vn, kColBf16Stride, kChunk, kScanCols, ws.v_new + row_first * Dv + col0,
            static_cast<int64_t>(Hv) * Dv, len, cols);
  if (tid < kChunk)
    sm.exp_gamma[tid] = tid < len ? expf(ws.gamma[row_first + static_cast<int64_t>(tid) * Hv]) : 0.0f;
  wait_tile_loads();
  __syncthreads();
  const int m0 = 16 * (warp & 3), n0 = 32 * (warp >> 2);
  float acc[1][4][4];
  zero_acc(acc);
  warp_mma<1, 4, kD, kD / 16>(acc, rows_of<kBf16Stride>(sm.q), m0, rows_of<kColBf16Stride>(sm.h), n0);
  for_each_acc<1, 4>(m0, n0, [&](int mt, int nt, int r, int i, int) {
    acc[mt][nt][r] *= scale * sm.exp_gamma[i];
  });
  warp_mma<1, 4, kChunk, kChunk / 16>(acc, rows_of<kSqBf16Stride>(sm.p), m0, rows_of<kColBf16Stride>(sm.vn), n0);
  // o leaves in 16-byte row pieces through V_new's tile once every warp is done reading it (rows
  // past len and columns past Dv not stored); a head dim that is not a multiple of 8, or an o not
  // on 16 bytes, stores element by element.
  const bool staged = Dv % 8 == 0 && (reinterpret_cast<uintptr_t>(o) & 15) == 0;
  if (!staged) {
    for_each_acc<1, 4>(m0, n0, [&](int mt, int nt, int r, int i, int e) {
      if (i < len && e < cols)
        o[(row_first + static_cast<int64_t>(i) * Hv) * Dv + col0 + e] = __float2bfloat16(acc[mt][nt][r]);
    });
    return;
  }
  __syncthreads();
  store_acc_bf16_pairs<1, 4, kColBf16Stride>(acc, sm.vn, m0, n0);
  __syncthreads();
  copy_tile_rows<kScanCols, kColBf16Stride, kThreads>(o + row_first * Dv + col0, static_cast<int64_t>(Hv) * Dv, sm.vn,
                                                      len, cols);
}

}  // namespace

size_t carve_workspace(const GatedDeltaRuleShape& s, bool backward, void* base, Workspace* out) {
  const GatedDeltaRuleWorkspaceLayout layout = gated_delta_rule_workspace_layout(
      s.num_tokens, s.num_seqs, s.num_key_heads, s.num_value_heads, s.key_dim, s.value_dim, backward);
  if (out == nullptr) return layout.total;
  auto* bytes = static_cast<char*>(base);
  auto at = [&](size_t offset) -> void* { return base == nullptr ? nullptr : bytes + offset; };
  Workspace ws{};
  ws.chunks = static_cast<ChunkInfo*>(at(layout.chunks));
  ws.chunk_count = static_cast<int*>(at(layout.chunk_count));
  ws.chunk_offsets = static_cast<int*>(at(layout.chunk_offsets));
  ws.slot_offsets = static_cast<int*>(at(layout.slot_offsets));
  ws.gamma = static_cast<float*>(at(layout.gamma));
  ws.w = static_cast<__nv_bfloat16*>(at(layout.w));
  ws.v_new = static_cast<__nv_bfloat16*>(at(layout.v_new));
  ws.p = static_cast<__nv_bfloat16*>(at(layout.p));
  ws.a_inv = static_cast<__nv_bfloat16*>(at(layout.a_inv));
  ws.h = static_cast<__nv_bfloat16*>(at(layout.h));
  if (backward) {
    ws.dh = static_cast<__nv_bfloat16*>(at(layout.dh));
    ws.dv_new = static_cast<__nv_bfloat16*>(at(layout.dv_new));
    ws.dw = static_cast<__nv_bfloat16*>(at(layout.dw));
    ws.dq_acc = static_cast<float*>(at(layout.dq_acc));
    ws.dk_acc = static_cast<float*>(at(layout.dk_acc));
    ws.dgamma = static_cast<float*>(at(layout.dgamma));
  }
  *out = ws;
  return layout.total;
}

size_t carve_backward_after_forward(const GatedDeltaRuleShape& s, const void* forward, void* base, Workspace* out) {
  const GatedDeltaRuleWorkspaceLayout layout = gated_delta_rule_workspace_layout(
      s.num_tokens, s.num_seqs, s.num_key_heads, s.num_value_heads, s.key_dim, s.value_dim, true);
  const size_t own = layout.total - layout.forward_total;
  if (out == nullptr) return own;
  // The forward's arrays where the forward left them (the same offsets as in its own layout), the
  // backward's shifted to `base`.
  carve_workspace(s, false, const_cast<void*>(forward), out);
  auto at = [&](size_t offset) -> void* { return static_cast<char*>(base) + (offset - layout.forward_total); };
  out->dh = static_cast<__nv_bfloat16*>(at(layout.dh));
  out->dv_new = static_cast<__nv_bfloat16*>(at(layout.dv_new));
  out->dw = static_cast<__nv_bfloat16*>(at(layout.dw));
  out->dq_acc = static_cast<float*>(at(layout.dq_acc));
  out->dk_acc = static_cast<float*>(at(layout.dk_acc));
  out->dgamma = static_cast<float*>(at(layout.dgamma));
  return own;
}

size_t device_smem_limit() {
  // The kernel path's limit (kernels/common/kernel_path_cuda.h): sm_80's 163 KB unless the sm_90a
  // kernels run, so a compute_80 binary on the H200 keeps the A800's limit by itself.
  return kernel_path().max_shared_bytes;
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
  CHECK(max_chunks(s) * s.num_value_heads * ((s.value_dim + kScanCols - 1) / kScanCols) < (int64_t{1} << 31), op,
        ": ", s.num_tokens, " tokens in ", s.num_seqs, " sequences x ", s.num_value_heads,
        " value heads overflow the output kernel's 32-bit block numbers");
}

void launch_build_chunk_table(const GatedDeltaRuleShape& s, const Workspace& ws,
                              cudaStream_t stream) {
  build_chunk_table_kernel<<<1, kThreads, 0, stream>>>(s.cu_seqlens, s.num_seqs,
                                                       static_cast<int>(max_chunks(s)), ws.chunks,
                                                       ws.chunk_count, ws.chunk_offsets,
                                                       ws.slot_offsets);
  CUDA_CHECK_LAUNCH();
}

void launch_prepare_chunks(const GatedDeltaRuleShape& s, float scale, const __nv_bfloat16* q,
                           const __nv_bfloat16* k, const __nv_bfloat16* v, const float* g,
                           const float* beta, const Workspace& ws, cudaStream_t stream) {
  const size_t smem = sizeof(PrepareSmem);
  allow_smem(prepare_chunks_kernel, smem);
  const dim3 grid(static_cast<unsigned>(max_chunks(s)), s.num_value_heads);
  prepare_chunks_kernel<<<grid, kThreads, smem, stream>>>(s, scale, q, k, v, g, beta, ws);
  CUDA_CHECK_LAUNCH();
}

bool launch_state_scan(const GatedDeltaRuleShape& s, const __nv_bfloat16* k, const float* initial_state,
                       float* final_state, const Workspace& ws, const ScanOutput& output, cudaStream_t stream) {
  const dim3 grid(s.num_seqs, s.num_value_heads,
                  (s.value_dim + kStateScanCols - 1) / kStateScanCols);
  // The stage count follows the kernel path, not the GPU: the forced sm_80 path on a Hopper GPU
  // runs what an A800 runs (one stage, and the outputs by the output kernel: ScanOutputSmem says why).
  const auto launch = [&](auto kernel, size_t smem) {
    allow_smem(kernel, smem);
    kernel<<<grid, kThreads, smem, stream>>>(s, k, initial_state, final_state, ws, output);
    CUDA_CHECK_LAUNCH();
  };
  const bool with_output = output.o != nullptr && kernel_path().sm90a;
  if (with_output)
    launch(state_scan_kernel<2, true>, sizeof(ScanSmem<2>) + sizeof(ScanOutputSmem<2>));
  else if (kernel_path().sm90a)
    launch(state_scan_kernel<2, false>, sizeof(ScanSmem<2>));
  else
    launch(state_scan_kernel<1, false>, sizeof(ScanSmem<1>));
  return with_output;
}

void launch_state_scan(const GatedDeltaRuleShape& s, const __nv_bfloat16* k, const float* initial_state,
                       float* final_state, const Workspace& ws, cudaStream_t stream) {
  launch_state_scan(s, k, initial_state, final_state, ws, ScanOutput{}, stream);
}

void launch_output(const GatedDeltaRuleShape& s, float scale, const __nv_bfloat16* q,
                   const float* initial_state, const Workspace& ws, __nv_bfloat16* o,
                   cudaStream_t stream) {
  const size_t smem = sizeof(OutputSmem);
  allow_smem(output_kernel, smem);
  const dim3 grid(static_cast<unsigned>(max_chunks(s)), s.num_value_heads, (s.value_dim + kScanCols - 1) / kScanCols);
  output_kernel<<<grid, kThreads, smem, stream>>>(s, scale, q, initial_state, ws, o);
  CUDA_CHECK_LAUNCH();
}

void run_forward(const GatedDeltaRuleShape& shape, float scale, const __nv_bfloat16* q,
                 const __nv_bfloat16* k, const __nv_bfloat16* v, const float* g, const float* beta,
                 const float* initial_state, __nv_bfloat16* o, float* final_state,
                 const Workspace& ws, cudaStream_t stream, StageMarks* marks) {
  mark_stage(marks, "forward start", stream);
  launch_build_chunk_table(shape, ws, stream);
  // An empty batch still writes the final states (= initial states) below, so no early return.
  if (shape.num_tokens > 0) launch_prepare_chunks(shape, scale, q, k, v, g, beta, ws, stream);
  mark_stage(marks, "forward chunk table + prepare (UT/WY)", stream);
  // On Hopper the scan writes o as it goes; the sm_80 path runs the output kernel after it.
  const bool output_done = launch_state_scan(shape, k, initial_state, final_state, ws, ScanOutput{scale, q, o}, stream);
  mark_stage(marks, output_done ? "forward state scan + output" : "forward state scan", stream);
  if (!output_done && shape.num_tokens > 0) launch_output(shape, scale, q, initial_state, ws, o, stream);
  if (!output_done) mark_stage(marks, "forward output", stream);
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
  // Its slots are read with 16-byte accesses from 256-byte aligned offsets.
  CHECK(reinterpret_cast<uintptr_t>(workspace) % 256 == 0, "gated_delta_rule_forward_cuda: the workspace must be "
        "256-byte aligned");
  Workspace ws{};
  carve_workspace(shape, false, workspace, &ws);
  run_forward(shape, scale, q, k, v, g, beta, initial_state, o, final_state, ws, stream, nullptr);
}

}  // namespace deltamoe
