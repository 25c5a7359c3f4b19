// Router kernels: one warp per token holds its E probabilities in registers (E <= 512), picks the
// top K by K rounds of a warp arg-max, and the matching backward; projections through cuBLASLt.
#include <algorithm>
#include <cfloat>
#include <climits>

#include "core/cuda_check.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/moe_router/moe_router_cuda.h"

namespace deltamoe {

namespace {

constexpr int kPerLane = static_cast<int>(kRouterMaxExperts / 32);
constexpr int kWarpsPerBlock = 8;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int d = 16; d > 0; d /= 2) v += __shfl_xor_sync(0xffffffffu, v, d);
  return v;
}

__global__ void router_forward_kernel(const float* logits, float* probs, int32_t* topk_idx, float* topk_weight,
                                      int64_t num_tokens, int num_experts, int top_k) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= num_tokens) return;
  const float* row = logits + t * num_experts;
  float v[kPerLane];
  float max_logit = -FLT_MAX;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < num_experts ? row[e] : -FLT_MAX;
    max_logit = fmaxf(max_logit, v[j]);
  }
#pragma unroll
  for (int d = 16; d > 0; d /= 2) max_logit = fmaxf(max_logit, __shfl_xor_sync(0xffffffffu, max_logit, d));
  float sum = 0;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < num_experts ? expf(v[j] - max_logit) : 0.0f;
    sum += v[j];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    v[j] /= sum;
    if (e < num_experts) probs[t * num_experts + e] = v[j];
  }
  // K rounds of arg-max over the not-yet-taken experts; ties go to the lower index.
  unsigned taken = 0;
  float selected_sum = 0, my_prob = 0;
  int my_expert = 0;
  for (int k = 0; k < top_k; ++k) {
    float best = -1.0f;
    int best_e = INT_MAX;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      if (e < num_experts && !((taken >> j) & 1u) && v[j] > best) best = v[j], best_e = e;
    }
#pragma unroll
    for (int d = 16; d > 0; d /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, best, d);
      const int other_e = __shfl_xor_sync(0xffffffffu, best_e, d);
      if (other > best || (other == best && other_e < best_e)) best = other, best_e = other_e;
    }
    if (best_e == INT_MAX) best_e = k, best = 0.0f;  // NaN logits: keep indices valid and distinct
    if ((best_e & 31) == lane) taken |= 1u << (best_e >> 5);
    if (lane == k) my_expert = best_e, my_prob = best;
    selected_sum += best;
  }
  if (lane < top_k) {
    topk_idx[t * top_k + lane] = my_expert;
    topk_weight[t * top_k + lane] = my_prob / selected_sum;
  }
}

// w_k = p_k / S: dp_k = (dw_k - sum_j dw_j w_j) / S on the selected experts, 0 elsewhere; then
// d_logits = p (dp - sum p dp). Every expert gets -p inner first, the K selected add p_k dp_k.
__global__ void router_backward_kernel(const float* probs, const int32_t* topk_idx, const float* topk_weight,
                                       const float* d_topk_weight, float* d_logits, __nv_bfloat16* d_logits_bf16,
                                       bool accumulate, int64_t num_tokens, int num_experts, int top_k) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= num_tokens) return;
  const float* p = probs + t * num_experts;
  float* d_row = d_logits + t * num_experts;
  int expert = 0;
  float p_sel = 0, w = 0, dw = 0;
  if (lane < top_k) {
    expert = topk_idx[t * top_k + lane];
    p_sel = p[expert];
    w = topk_weight[t * top_k + lane];
    dw = d_topk_weight[t * top_k + lane];
  }
  const float selected_sum = warp_sum(p_sel);
  const float weighted = warp_sum(dw * w);
  const float dp = lane < top_k ? (dw - weighted) / selected_sum : 0.0f;
  const float inner = warp_sum(p_sel * dp);
  for (int e = lane; e < num_experts; e += 32) d_row[e] = (accumulate ? d_row[e] : 0.0f) - p[e] * inner;
  __syncwarp();
  if (lane < top_k) d_row[expert] += p_sel * dp;
  __syncwarp();
  if (d_logits_bf16)
    for (int e = lane; e < num_experts; e += 32) d_logits_bf16[t * num_experts + e] = __float2bfloat16(d_row[e]);
}

void check_router_sizes(const char* where, int64_t num_tokens, int64_t num_experts, int64_t top_k) {
  CHECK(num_experts >= 1 && num_experts <= kRouterMaxExperts, where, ": expert count ", num_experts, " must be in [1, ",
        kRouterMaxExperts, "]");
  CHECK(top_k >= 1 && top_k <= num_experts && top_k <= kRouterMaxTopK, where, ": top_k ", top_k, " must be in [1, ",
        std::min(num_experts, kRouterMaxTopK), "]");
  CHECK(num_tokens >= 0, where, ": negative token count ", num_tokens);
}

unsigned token_blocks(int64_t num_tokens) {
  return static_cast<unsigned>((num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

namespace {

// logits (beta 0: =, beta 1: +=) x [T, C] bf16 @ w [E, C]^T, fp32 accumulate and output.
void router_product(GemmContext& gemm, const __nv_bfloat16* x, const __nv_bfloat16* w, float* logits, float beta,
                    int64_t num_tokens, int64_t hidden, int64_t num_experts, cudaStream_t stream) {
  gemm_bf16_cuda(gemm, false, true, num_tokens, num_experts, hidden, 1.0f, x, hidden, w, hidden, beta, logits,
                 DType::f32, num_experts, stream);
}

}  // namespace

void moe_router_logits_cuda(GemmContext& gemm, const __nv_bfloat16* x, const __nv_bfloat16* w, float* logits,
                            int64_t num_tokens, int64_t hidden, int64_t num_experts, cudaStream_t stream) {
  CHECK(num_tokens >= 0 && hidden >= 1 && num_experts >= 1, "moe_router_logits_cuda: bad sizes T=", num_tokens,
        " C=", hidden, " E=", num_experts);
  if (num_tokens == 0) return;
  router_product(gemm, x, w, logits, 0.0f, num_tokens, hidden, num_experts, stream);
}

void moe_router_logits_split_cuda(GemmContext& gemm, const __nv_bfloat16* x_hi, const __nv_bfloat16* x_lo,
                                  const __nv_bfloat16* w_hi, const __nv_bfloat16* w_lo, float* logits,
                                  int64_t num_tokens, int64_t hidden, int64_t num_experts, cudaStream_t stream) {
  CHECK(num_tokens >= 0 && hidden >= 1 && num_experts >= 1, "moe_router_logits_split_cuda: bad sizes T=", num_tokens,
        " C=", hidden, " E=", num_experts);
  CHECK(x_hi != nullptr && x_lo != nullptr && w_hi != nullptr && w_lo != nullptr && logits != nullptr,
        "moe_router_logits_split_cuda: every operand is required");
  if (num_tokens == 0) return;
  // The small terms first, then the large one: lo x lo (~2^-18 relative) is left out.
  router_product(gemm, x_lo, w_hi, logits, 0.0f, num_tokens, hidden, num_experts, stream);
  router_product(gemm, x_hi, w_lo, logits, 1.0f, num_tokens, hidden, num_experts, stream);
  router_product(gemm, x_hi, w_hi, logits, 1.0f, num_tokens, hidden, num_experts, stream);
}

void moe_router_forward_cuda(const float* logits, float* probs, int32_t* topk_idx, float* topk_weight,
                             int64_t num_tokens, int64_t num_experts, int64_t top_k, cudaStream_t stream) {
  check_router_sizes("moe_router_forward_cuda", num_tokens, num_experts, top_k);
  if (num_tokens == 0) return;
  router_forward_kernel<<<token_blocks(num_tokens), 32 * kWarpsPerBlock, 0, stream>>>(
      logits, probs, topk_idx, topk_weight, num_tokens, static_cast<int>(num_experts), static_cast<int>(top_k));
  CUDA_CHECK_LAUNCH();
}

void moe_router_backward_cuda(const float* probs, const int32_t* topk_idx, const float* topk_weight,
                              const float* d_topk_weight, float* d_logits, __nv_bfloat16* d_logits_bf16,
                              bool accumulate, int64_t num_tokens, int64_t num_experts, int64_t top_k,
                              cudaStream_t stream) {
  check_router_sizes("moe_router_backward_cuda", num_tokens, num_experts, top_k);
  if (num_tokens == 0) return;
  router_backward_kernel<<<token_blocks(num_tokens), 32 * kWarpsPerBlock, 0, stream>>>(
      probs, topk_idx, topk_weight, d_topk_weight, d_logits, d_logits_bf16, accumulate, num_tokens,
      static_cast<int>(num_experts), static_cast<int>(top_k));
  CUDA_CHECK_LAUNCH();
}

void moe_router_logits_backward_cuda(GemmContext& gemm, const __nv_bfloat16* x, const __nv_bfloat16* w,
                                     const __nv_bfloat16* d_logits_bf16, __nv_bfloat16* dx, bool accumulate_dx,
                                     float* d_w, int64_t num_tokens, int64_t hidden, int64_t num_experts,
                                     cudaStream_t stream) {
  CHECK(num_tokens >= 0 && hidden >= 1 && num_experts >= 1, "moe_router_logits_backward_cuda: bad sizes T=", num_tokens,
        " C=", hidden, " E=", num_experts);
  if (num_tokens == 0) return;
  const int64_t T = num_tokens, C = hidden, E = num_experts;
  // dx [T, C] = d_logits [T, E] W [E, C].
  gemm_bf16_cuda(gemm, false, false, T, C, E, 1.0f, d_logits_bf16, E, w, C, accumulate_dx ? 1.0f : 0.0f, dx,
                 DType::bf16, C, stream);
  // d_w [E, C] += d_logits^T [E, T] x [T, C].
  gemm_bf16_cuda(gemm, true, false, E, C, T, 1.0f, d_logits_bf16, E, x, C, 1.0f, d_w, DType::f32, C, stream);
}

}  // namespace deltamoe
