// Device-side token dispatch of the routed experts: the routing plan (per-expert counts and
// offsets, expert-major order, deterministic, no host sync), permute (gather) and combine.
#include <algorithm>

#include "core/cuda_check.h"
#include "core/workspace_carver.h"
#include "kernels/moe_experts/moe_experts_cuda.h"

namespace deltamoe {

namespace {

using nvbf16 = __nv_bfloat16;

constexpr int kSlotsPerChunk = kMoeSlotsPerChunk;
// Experts are held in shared memory by the plan kernels (Qwen3.5 has 256 or 512).
constexpr int64_t kMaxExperts = 8192;

int64_t num_chunks(int64_t slots) { return (slots + kSlotsPerChunk - 1) / kSlotsPerChunk; }

// counts[chunk, e] = slots of the chunk routed to expert e.
__global__ void count_chunk_kernel(const int32_t* topk_idx, int64_t slots, int num_experts, int32_t* counts) {
  extern __shared__ int32_t shared_counts[];
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) shared_counts[e] = 0;
  __syncthreads();
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * kSlotsPerChunk + threadIdx.x;
  if (slot < slots) atomicAdd(&shared_counts[topk_idx[slot]], 1);  // integer counts: order-free
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
    counts[static_cast<int64_t>(blockIdx.x) * num_experts + e] = shared_counts[e];
}

// One block: expert totals -> exclusive offsets; then chunk_rows[chunk, e] = the first row of that
// chunk's slots of expert e (the offset plus the counts of earlier chunks).
__global__ void scan_counts_kernel(const int32_t* __restrict__ counts, int chunks, int num_experts,
                                   int32_t* __restrict__ expert_offsets, int32_t* __restrict__ chunk_rows) {
  extern __shared__ int32_t shared_offsets[];  // [E]
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int total = 0;
    // Independent loads: unrolled so that many are in flight (one thread walks all chunks).
#pragma unroll 16
    for (int c = 0; c < chunks; ++c) total += counts[static_cast<int64_t>(c) * num_experts + e];
    shared_offsets[e] = total;
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int carry = 0;
    for (int base = 0; base < num_experts; base += 32) {
      const int e = base + lane;
      const int value = e < num_experts ? shared_offsets[e] : 0;
      int inclusive = value;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int up = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += up;
      }
      if (e < num_experts) {
        shared_offsets[e] = carry + inclusive - value;
        expert_offsets[e] = carry + inclusive - value;
      }
      carry += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (lane == 0) expert_offsets[num_experts] = carry;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int running = shared_offsets[e];
#pragma unroll 16
    for (int c = 0; c < chunks; ++c) {
      const int64_t at = static_cast<int64_t>(c) * num_experts + e;
      chunk_rows[at] = running;
      running += counts[at];
    }
  }
}

// One warp per chunk walks its slots in order, 32 at a time; lanes with the same expert get
// consecutive rows in lane order (__match_any_sync), so rows follow the flat slot order.
__global__ void assign_rows_kernel(const int32_t* topk_idx, int64_t slots, int num_experts, const int32_t* chunk_rows,
                                   int32_t* sorted_slot, int32_t* row_of_slot) {
  extern __shared__ int32_t next_row[];  // [E]
  const int lane = threadIdx.x;
  const int64_t chunk = blockIdx.x;
  for (int e = lane; e < num_experts; e += 32) next_row[e] = chunk_rows[chunk * num_experts + e];
  __syncwarp();
  for (int i = 0; i < kSlotsPerChunk; i += 32) {
    const int64_t slot = chunk * kSlotsPerChunk + i + lane;
    const bool valid = slot < slots;
    const int expert = valid ? topk_idx[slot] : -1;
    const unsigned same = __match_any_sync(0xffffffffu, expert);
    const unsigned lower_lanes = (1u << lane) - 1u;
    if (valid) {
      const int row = next_row[expert] + __popc(same & lower_lanes);
      sorted_slot[row] = static_cast<int32_t>(slot);
      row_of_slot[slot] = row;
    }
    __syncwarp();
    if (valid && (same & lower_lanes) == 0) next_row[expert] += __popc(same);
    __syncwarp();
  }
}

// xp[r] = x[sorted_slot[r] / K]: a warp per row (grid-stride over rows), 16-byte chunks when rows
// are 16-byte multiples, each lane's kBatch loads issued before its stores. (A block per row, one
// chunk at a time per thread, ran at ~1.7x its memory floor.)
constexpr int kPermuteBatch = 8;  // a 2048-wide bf16 row is 8 chunks a lane

template <bool kVector>
__global__ void permute_kernel(const nvbf16* x, const int32_t* sorted_slot, nvbf16* xp, int64_t rows, int64_t hidden,
                               int top_k) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const int64_t token = sorted_slot[r] / top_k;
    if constexpr (kVector) {
      const uint4* src = reinterpret_cast<const uint4*>(x + token * hidden);
      uint4* dst = reinterpret_cast<uint4*>(xp + r * hidden);
      const int64_t chunks = hidden / 8;
      for (int64_t base = 0; base < chunks; base += 32 * kPermuteBatch) {
        uint4 v[kPermuteBatch];
#pragma unroll
        for (int i = 0; i < kPermuteBatch; ++i) {
          const int64_t c = base + lane + 32 * i;
          if (c < chunks) v[i] = src[c];
        }
#pragma unroll
        for (int i = 0; i < kPermuteBatch; ++i) {
          const int64_t c = base + lane + 32 * i;
          if (c < chunks) dst[c] = v[i];
        }
      }
    } else {
      for (int64_t i = lane; i < hidden; i += 32) xp[r * hidden + i] = x[token * hidden + i];
    }
  }
}

// Eight floats rounded to bf16 in one 16-byte word (kept in registers, no local array).
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&pair);
}
__device__ __forceinline__ uint4 pack_bf16x8(const float* v) {
  return make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7]));
}

// y[t] = sum_k w[t,k] yp[row_of_slot[t*K+k]], k in order, fp32. With 16-byte chunks and K up to
// kCombineLoads, a thread's K chunks are loaded before they are summed (in k order, as before): the
// loads of a token's rows overlap instead of waiting one after the other.
constexpr int kCombineLoads = 8;

__device__ __forceinline__ void add_weighted_chunk(float (&acc)[8], float w, const uint4& raw) {
  const nvbf16* v = reinterpret_cast<const nvbf16*>(&raw);
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] += w * __bfloat162float(v[e]);
}

template <bool kVector>
__global__ void combine_kernel(const nvbf16* yp, const int32_t* row_of_slot, const float* topk_weight, nvbf16* y,
                               int64_t hidden, int top_k) {
  const int64_t t = blockIdx.x;
  if constexpr (kVector) {
    for (int64_t c8 = threadIdx.x; c8 < hidden / 8; c8 += blockDim.x) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (top_k <= kCombineLoads) {
        uint4 raw[kCombineLoads];
#pragma unroll
        for (int k = 0; k < kCombineLoads; ++k)
          if (k < top_k) raw[k] = reinterpret_cast<const uint4*>(yp + row_of_slot[t * top_k + k] * hidden)[c8];
#pragma unroll
        for (int k = 0; k < kCombineLoads; ++k)
          if (k < top_k) add_weighted_chunk(acc, topk_weight ? topk_weight[t * top_k + k] : 1.0f, raw[k]);
      } else {
        for (int k = 0; k < top_k; ++k) {
          const int64_t row = row_of_slot[t * top_k + k];
          const float w = topk_weight ? topk_weight[t * top_k + k] : 1.0f;
          add_weighted_chunk(acc, w, reinterpret_cast<const uint4*>(yp + row * hidden)[c8]);
        }
      }
      reinterpret_cast<uint4*>(y + t * hidden)[c8] = pack_bf16x8(acc);
    }
  } else {
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
      float acc = 0;
      for (int k = 0; k < top_k; ++k) {
        const int64_t row = row_of_slot[t * top_k + k];
        const float w = topk_weight ? topk_weight[t * top_k + k] : 1.0f;
        acc += w * __bfloat162float(yp[row * hidden + c]);
      }
      y[t * hidden + c] = __float2bfloat16(acc);
    }
  }
}

bool vector_rows(const void* a, const void* b, int64_t hidden) {
  return hidden % 8 == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0;
}

}  // namespace

MoeRoutingPlan moe_routing_plan_in(void* memory, int64_t num_tokens, int64_t num_experts, int64_t top_k) {
  const int64_t slots = num_tokens * top_k;
  char* at = static_cast<char*>(memory);
  MoeRoutingPlan plan;
  plan.expert_offsets = reinterpret_cast<int32_t*>(at);
  at += align256((num_experts + 1) * sizeof(int32_t));
  plan.sorted_slot = reinterpret_cast<int32_t*>(at);
  at += align256(slots * sizeof(int32_t));
  plan.row_of_slot = reinterpret_cast<int32_t*>(at);
  at += align256(slots * sizeof(int32_t));
  plan.chunk_counts = reinterpret_cast<int32_t*>(at);
  at += align256(std::max<int64_t>(num_chunks(slots), 1) * num_experts * sizeof(int32_t));
  plan.chunk_rows = reinterpret_cast<int32_t*>(at);
  return plan;
}

void moe_routing_plan_cuda(const int32_t* topk_idx, const MoeRoutingPlan& plan, int64_t num_tokens, int64_t num_experts,
                           int64_t top_k, cudaStream_t stream) {
  CHECK(num_experts >= 1 && num_experts <= kMaxExperts, "moe_routing_plan_cuda: expert count ", num_experts,
        " must be in [1, ", kMaxExperts, "]");
  CHECK(top_k >= 1 && top_k <= num_experts, "moe_routing_plan_cuda: top_k ", top_k, " must be in [1, ", num_experts,
        "]");
  CHECK(num_tokens >= 0 && num_tokens * top_k < (int64_t{1} << 31), "moe_routing_plan_cuda: ", num_tokens,
        " tokens x top_k ", top_k, " exceed 32-bit row indices");
  const int64_t slots = num_tokens * top_k;
  if (slots == 0) {
    CUDA_CHECK(cudaMemsetAsync(plan.expert_offsets, 0, (num_experts + 1) * sizeof(int32_t), stream));
    return;
  }
  const int experts = static_cast<int>(num_experts);
  const int64_t chunks = num_chunks(slots);
  const size_t shared = num_experts * sizeof(int32_t);
  count_chunk_kernel<<<static_cast<unsigned>(chunks), kSlotsPerChunk, shared, stream>>>(topk_idx, slots, experts,
                                                                                        plan.chunk_counts);
  CUDA_CHECK_LAUNCH();
  scan_counts_kernel<<<1, 1024, shared, stream>>>(plan.chunk_counts, static_cast<int>(chunks), experts,
                                                  plan.expert_offsets, plan.chunk_rows);
  CUDA_CHECK_LAUNCH();
  assign_rows_kernel<<<static_cast<unsigned>(chunks), 32, shared, stream>>>(topk_idx, slots, experts, plan.chunk_rows,
                                                                            plan.sorted_slot, plan.row_of_slot);
  CUDA_CHECK_LAUNCH();
}

void moe_permute_cuda(const __nv_bfloat16* x, const int32_t* sorted_slot, __nv_bfloat16* xp, int64_t rows,
                      int64_t hidden, int64_t top_k, cudaStream_t stream) {
  CHECK(hidden >= 1 && top_k >= 1 && rows >= 0, "moe_permute_cuda: hidden ", hidden, ", top_k ", top_k, ", rows ",
        rows);
  if (rows == 0) return;
  constexpr int kWarpsPerBlock = 8;
  const auto grid = static_cast<unsigned>(std::min<int64_t>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, 132 * 8));
  if (vector_rows(x, xp, hidden))
    permute_kernel<true><<<grid, 32 * kWarpsPerBlock, 0, stream>>>(x, sorted_slot, xp, rows, hidden, top_k);
  else
    permute_kernel<false><<<grid, 32 * kWarpsPerBlock, 0, stream>>>(x, sorted_slot, xp, rows, hidden, top_k);
  CUDA_CHECK_LAUNCH();
}

void moe_combine_cuda(const __nv_bfloat16* yp, const int32_t* row_of_slot, const float* topk_weight, __nv_bfloat16* y,
                      int64_t num_tokens, int64_t hidden, int64_t top_k, cudaStream_t stream) {
  CHECK(hidden >= 1 && top_k >= 1 && num_tokens >= 0, "moe_combine_cuda: hidden ", hidden, ", top_k ", top_k,
        ", tokens ", num_tokens);
  if (num_tokens == 0) return;
  const unsigned grid = static_cast<unsigned>(num_tokens);
  const int k = static_cast<int>(top_k);
  if (vector_rows(yp, y, hidden))
    combine_kernel<true><<<grid, 256, 0, stream>>>(yp, row_of_slot, topk_weight, y, hidden, k);
  else
    combine_kernel<false><<<grid, 256, 0, stream>>>(yp, row_of_slot, topk_weight, y, hidden, k);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
