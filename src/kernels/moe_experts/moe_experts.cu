// Routed experts forward and backward on the device: permute, grouped gate_up / down GEMMs
// (grouped_gemm over the plan's device offsets), SiLU gate kernels, combine.
#include <algorithm>

#include "core/cuda_check.h"
#include "core/workspace_carver.h"
#include "kernels/gemm/bf16_vector.cuh"
#include "kernels/grouped_gemm/grouped_gemm_cuda.h"
#include "kernels/moe_experts/moe_experts_cuda.h"

namespace deltamoe {

namespace {

using nvbf16 = __nv_bfloat16;

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + __expf(-x)); }

// h[r, i] = silu(gu[r, i]) * gu[r, I + i], fp32 math, nvbf16 out; each thread V adjacent i (V = 8
// when I is a multiple of 8 and the rows 16-byte aligned). Index is uint32_t where the vector count
// fits 31 bits (always at the model's sizes): a 64-bit division per vector made this pass 2.75x its
// memory floor.
template <int V, typename Index>
__global__ void swiglu_forward_kernel(const nvbf16* gu, nvbf16* h, Index rows, Index inter) {
  const Index per_row = inter / V, total = rows * per_row;
  for (Index idx = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<Index>(gridDim.x) * blockDim.x) {
    const Index r = idx / per_row;
    const int64_t row = static_cast<int64_t>(r), i = static_cast<int64_t>(idx - r * per_row) * V;
    float g[V], u[V];
    load_bf16_as_f32<V>(gu + row * 2 * inter + i, g);
    load_bf16_as_f32<V>(gu + row * 2 * inter + inter + i, u);
#pragma unroll
    for (int k = 0; k < V; ++k) g[k] = g[k] * sigmoidf(g[k]) * u[k];
    store_f32_as_bf16<V>(h + row * inter + i, g);
  }
}

// One warp per expert-major row r with weight w of its slot; dh_u = dy W_down (unweighted; bf16, or
// fp32 when the down adapter added to it):
//   d_topk_weight[slot] = dh_u . h  (= dy . y_e),  dh = w dh_u,
//   d_gate = dh u silu'(g), d_up = dh silu(g)  -> d_gu (may be gu itself: each element is read
//   before it is written, by the same thread),
//   hw = w h (nvbf16) for the down-projection weight gradient.
// Each lane takes V adjacent i at a time (V = 8 as in the forward).
template <int V, typename TDh>
__global__ void swiglu_backward_kernel(const nvbf16* gu, nvbf16* d_gu, const TDh* dh_u, const int32_t* sorted_slot,
                                       const float* topk_weight, float* d_topk_weight, nvbf16* hw, int64_t rows,
                                       int64_t inter) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int32_t slot = sorted_slot[r];
  const float w = topk_weight[slot];
  const nvbf16* row = gu + r * 2 * inter;
  nvbf16* d_row = d_gu + r * 2 * inter;
  float d_weight = 0;
  for (int64_t i = static_cast<int64_t>(lane) * V; i < inter; i += 32 * V) {
    float g[V], u[V], d_hu[V], d_gate[V], d_up[V], h[V];
    load_bf16_as_f32<V>(row + i, g);
    load_bf16_as_f32<V>(row + inter + i, u);
    load_as_f32<V>(dh_u + r * inter + i, d_hu);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float s = sigmoidf(g[k]), silu = g[k] * s;
      d_weight += d_hu[k] * silu * u[k];
      const float dh = w * d_hu[k];
      d_gate[k] = dh * u[k] * s * (1.0f + g[k] * (1.0f - s));
      d_up[k] = dh * silu;
      h[k] = w * silu * u[k];
    }
    store_f32_as_bf16<V>(d_row + i, d_gate);
    store_f32_as_bf16<V>(d_row + inter + i, d_up);
    store_f32_as_bf16<V>(hw + r * inter + i, h);
  }
#pragma unroll
  for (int d = 16; d > 0; d /= 2) d_weight += __shfl_xor_sync(0xffffffffu, d_weight, d);
  if (lane == 0) d_topk_weight[slot] = d_weight;
}

// Whether the SwiGLU rows allow 16-byte accesses: I a multiple of 8, every base 16-byte aligned.
bool swiglu_vector_rows(int64_t inter, const void* a, const void* b, const void* c = nullptr) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return inter % 8 == 0 && aligned(a) && aligned(b) && aligned(c);
}

void check_dims(const MoeExpertsDims& d, const char* where) {
  CHECK(d.num_tokens >= 0 && d.hidden >= 1 && d.num_experts >= 1 && d.top_k >= 1 && d.top_k <= d.num_experts &&
            d.intermediate >= 1,
        where, ": bad sizes T=", d.num_tokens, " C=", d.hidden, " E=", d.num_experts, " K=", d.top_k,
        " I=", d.intermediate);
}

unsigned elementwise_grid(int64_t total) {
  return static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, int64_t{1} << 20));
}

template <int V>
void launch_swiglu_forward(const nvbf16* gu, nvbf16* h, int64_t rows, int64_t inter, cudaStream_t stream) {
  const int64_t vectors = rows * inter / V;
  if (vectors < (int64_t{1} << 31))
    swiglu_forward_kernel<V, uint32_t><<<elementwise_grid(vectors), 256, 0, stream>>>(
        gu, h, static_cast<uint32_t>(rows), static_cast<uint32_t>(inter));
  else
    swiglu_forward_kernel<V, int64_t><<<elementwise_grid(vectors), 256, 0, stream>>>(gu, h, rows, inter);
}

}  // namespace

namespace {

// The adapter products' dims for one fused weight over the plan's T K rows.
LoraExpertDims lora_dims(const MoeExpertsDims& d, int64_t in, int64_t out, int64_t rank) {
  return LoraExpertDims{d.num_experts, in, out, rank, d.num_tokens * d.top_k};
}

}  // namespace

size_t moe_experts_lora_workspace_bytes(const MoeExpertsDims& d, int64_t rank) {
  return std::max(lora_experts_workspace_bytes(lora_dims(d, d.hidden, 2 * d.intermediate, rank)),
                  lora_experts_workspace_bytes(lora_dims(d, d.intermediate, d.hidden, rank)));
}

void moe_experts_forward_cuda(const MoeExpertsDims& dims, const MoeRoutingPlan& plan, const __nv_bfloat16* x,
                              const float* topk_weight, const __nv_bfloat16* gate_up, const __nv_bfloat16* down,
                              __nv_bfloat16* y, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                              const MoeExpertsLora* lora, const MoeExpertRows* keep) {
  check_dims(dims, "moe_experts_forward_cuda");
  if (dims.num_tokens == 0) return;
  const int64_t rows = dims.num_tokens * dims.top_k, C = dims.hidden, I = dims.intermediate, E = dims.num_experts;
  WorkspaceCarver carve("moe_experts", workspace, workspace_bytes);
  const size_t tile_bytes = grouped_gemm_rows_workspace_bytes(E);
  void* tiles = carve.take<char>(static_cast<int64_t>(tile_bytes));
  nvbf16* xp_scratch = carve.take<nvbf16>(rows * C);  // later the expert outputs
  nvbf16* gu_scratch = carve.take<nvbf16>(rows * 2 * I);
  nvbf16* h = carve.take<nvbf16>(rows * I);
  nvbf16* xp = keep != nullptr && keep->inputs != nullptr ? keep->inputs : xp_scratch;
  nvbf16* gu = keep != nullptr && keep->gate_up != nullptr ? keep->gate_up : gu_scratch;

  moe_permute_cuda(x, plan.sorted_slot, xp, rows, C, dims.top_k, stream);
  grouped_gemm_rows_cuda(xp, gate_up, true, gu, DType::bf16, plan.expert_offsets, E, rows, 2 * I, C, tiles, tile_bytes,
                         stream);
  if (lora != nullptr && lora->gate_up.attached()) {
    lora_experts_forward_cuda(xp, lora->gate_up, plan.expert_offsets, gu, DType::bf16,
                              lora_dims(dims, C, 2 * I, lora->gate_up.rank), lora->workspace, lora->workspace_bytes,
                              stream);
  }
  if (swiglu_vector_rows(I, gu, h))
    launch_swiglu_forward<8>(gu, h, rows, I, stream);
  else
    launch_swiglu_forward<1>(gu, h, rows, I, stream);
  CUDA_CHECK_LAUNCH();
  nvbf16* y_expert = xp_scratch;
  grouped_gemm_rows_cuda(h, down, true, y_expert, DType::bf16, plan.expert_offsets, E, rows, C, I, tiles, tile_bytes,
                         stream);
  if (lora != nullptr && lora->down.attached()) {
    lora_experts_forward_cuda(h, lora->down, plan.expert_offsets, y_expert, DType::bf16,
                              lora_dims(dims, I, C, lora->down.rank), lora->workspace, lora->workspace_bytes, stream);
  }
  moe_combine_cuda(y_expert, plan.row_of_slot, topk_weight, y, dims.num_tokens, C, dims.top_k, stream);
}

void moe_experts_backward_cuda(const MoeExpertsDims& dims, const MoeRoutingPlan& plan, const __nv_bfloat16* x,
                               const float* topk_weight, const __nv_bfloat16* gate_up, const __nv_bfloat16* down,
                               const __nv_bfloat16* dy, __nv_bfloat16* dx, float* d_topk_weight, void* d_gate_up,
                               void* d_down, DType grad_dtype, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream, const MoeExpertsLora* lora, WeightGradOutput expert_grads,
                               const ExpertGradSquares* squares, const MoeExpertRows* kept) {
  check_dims(dims, "moe_experts_backward_cuda");
  CHECK(grad_dtype == DType::f32 || grad_dtype == DType::bf16,
        "moe_experts_backward_cuda: the expert weight gradients must be f32 or bf16, got ", dtype_name(grad_dtype));
  CHECK(squares == nullptr || expert_grads == WeightGradOutput::written,
        "moe_experts_backward_cuda: the gradients' sums of squares are formed when they are written");
  const bool gate_up_lora = lora != nullptr && lora->gate_up.attached();
  const bool down_lora = lora != nullptr && lora->down.attached();
  // A sum of squares whose gradient is not formed here (frozen, or no rows) is zero.
  if (squares != nullptr && (d_gate_up == nullptr || dims.num_tokens == 0))
    CUDA_CHECK(cudaMemsetAsync(squares->gate_up, 0, sizeof(double), stream));
  if (squares != nullptr && (d_down == nullptr || dims.num_tokens == 0))
    CUDA_CHECK(cudaMemsetAsync(squares->down, 0, sizeof(double), stream));
  if (dims.num_tokens == 0) {
    if (expert_grads == WeightGradOutput::written) {  // no rows: the written gradient is zero
      const size_t bytes = static_cast<size_t>(dims.num_experts * dims.intermediate * dims.hidden) *
                           dtype_size(grad_dtype);  // of d_down; d_gate_up has twice as many
      if (d_down != nullptr) CUDA_CHECK(cudaMemsetAsync(d_down, 0, bytes, stream));
      if (d_gate_up != nullptr) CUDA_CHECK(cudaMemsetAsync(d_gate_up, 0, 2 * bytes, stream));
    }
    return;
  }
  const int64_t rows = dims.num_tokens * dims.top_k, C = dims.hidden, I = dims.intermediate, E = dims.num_experts;
  WorkspaceCarver carve("moe_experts", workspace, workspace_bytes);
  const size_t tile_bytes = grouped_gemm_rows_workspace_bytes(E);
  void* tiles = carve.take<char>(static_cast<int64_t>(tile_bytes));
  nvbf16* xp_scratch = carve.take<nvbf16>(rows * C);
  nvbf16* dyp = carve.take<nvbf16>(rows * C);     // later reused for the permuted input gradient
  nvbf16* d_gu = carve.take<nvbf16>(rows * 2 * I);  // the recomputed gu, then (in place) d_gu
  // dh_u as the down product's dX in bf16, as autocast rounds it; fp32 when the down adapter adds
  // its share to it (one rounding after the sum, not one before it).
  const DType dh_dtype = down_lora ? DType::f32 : DType::bf16;
  void* dh_u = carve.take<float>(rows * I);  // the fp32 size either way: what the workspace plan holds
  nvbf16* hw = carve.take<nvbf16>(rows * I);

  // xp = x in expert-major order and gu = xp W_gu^T: the forward's kept rows, else formed again.
  const nvbf16* xp = kept != nullptr && kept->inputs != nullptr ? kept->inputs : xp_scratch;
  if (xp == xp_scratch) moe_permute_cuda(x, plan.sorted_slot, xp_scratch, rows, C, dims.top_k, stream);
  const nvbf16* kept_gate_up = kept != nullptr ? kept->gate_up : nullptr;
  const nvbf16* gu = kept_gate_up != nullptr ? kept_gate_up : d_gu;
  if (kept_gate_up == nullptr) {
    grouped_gemm_rows_cuda(xp, gate_up, true, d_gu, DType::bf16, plan.expert_offsets, E, rows, 2 * I, C, tiles,
                           tile_bytes, stream);
    if (gate_up_lora) {
      lora_experts_forward_cuda(xp, lora->gate_up, plan.expert_offsets, d_gu, DType::bf16,
                                lora_dims(dims, C, 2 * I, lora->gate_up.rank), lora->workspace, lora->workspace_bytes,
                                stream);
    }
  }
  // dh_u = dy W_down (down_e stored [C, I] = [K, N]).
  moe_permute_cuda(dy, plan.sorted_slot, dyp, rows, C, dims.top_k, stream);
  grouped_gemm_rows_cuda(dyp, down, false, dh_u, dh_dtype, plan.expert_offsets, E, rows, I, C, tiles, tile_bytes,
                         stream);
  if (down_lora) {
    // The down adapter's share of dh_u (its weight gradients need w h, formed below).
    LoraDeviceAdapter input_only = lora->down;
    input_only.grad_a = input_only.grad_b = nullptr;
    lora_experts_backward_cuda(nullptr, dyp, input_only, plan.expert_offsets, dh_u, DType::f32,
                               lora_dims(dims, I, C, lora->down.rank), lora->workspace, lora->workspace_bytes, stream);
  }
  const unsigned warps_per_block = 8;
  const auto swiglu_blocks = static_cast<unsigned>((rows + warps_per_block - 1) / warps_per_block);
  const auto swiglu_backward = [&](auto* dh) {
    if (swiglu_vector_rows(I, gu, dh, hw) && swiglu_vector_rows(I, d_gu, hw))
      swiglu_backward_kernel<8><<<swiglu_blocks, 32 * warps_per_block, 0, stream>>>(
          gu, d_gu, dh, plan.sorted_slot, topk_weight, d_topk_weight, hw, rows, I);
    else
      swiglu_backward_kernel<1><<<swiglu_blocks, 32 * warps_per_block, 0, stream>>>(
          gu, d_gu, dh, plan.sorted_slot, topk_weight, d_topk_weight, hw, rows, I);
  };
  if (dh_dtype == DType::f32)
    swiglu_backward(static_cast<const float*>(dh_u));
  else
    swiglu_backward(static_cast<const nvbf16*>(dh_u));
  CUDA_CHECK_LAUNCH();
  // d_down[e] (+)= (dy_e)^T (w h)_e ; d_gate_up[e] (+)= d_gu_e^T x_e (added to, or written).
  // Frozen experts (null gradients) skip their weight products.
  // With squares, each product also sums its gradient's squares (one after the other: one scratch).
  const WeightGradSquares down_squares =
      squares == nullptr ? WeightGradSquares{} : WeightGradSquares{squares->down, squares->divisor, squares->scratch};
  const WeightGradSquares gate_up_squares = squares == nullptr ? WeightGradSquares{}
                                                               : WeightGradSquares{squares->gate_up, squares->divisor,
                                                                                   squares->scratch};
  if (d_down != nullptr)
    grouped_gemm_weight_grad_cuda(dyp, hw, d_down, grad_dtype, plan.expert_offsets, E, C, I, expert_grads, stream,
                                  squares == nullptr ? nullptr : &down_squares);
  if (d_gate_up != nullptr)
    grouped_gemm_weight_grad_cuda(d_gu, xp, d_gate_up, grad_dtype, plan.expert_offsets, E, 2 * I, C, expert_grads,
                                  stream, squares == nullptr ? nullptr : &gate_up_squares);
  if (down_lora && lora->down.grad_a != nullptr) {
    // dA, dB of the down adapter from dY and the weighted activations (as d_down above).
    lora_experts_backward_cuda(hw, dyp, lora->down, plan.expert_offsets, nullptr, DType::f32,
                               lora_dims(dims, I, C, lora->down.rank), lora->workspace, lora->workspace_bytes, stream);
  }
  // dxp = d_gu W_gu (gate_up_e stored [2I, C] = [K, N]), then each token sums its K rows.
  nvbf16* dxp = dyp;
  grouped_gemm_rows_cuda(d_gu, gate_up, false, dxp, DType::bf16, plan.expert_offsets, E, rows, C, 2 * I, tiles,
                         tile_bytes, stream);
  if (gate_up_lora) {
    lora_experts_backward_cuda(xp, d_gu, lora->gate_up, plan.expert_offsets, dxp, DType::bf16,
                               lora_dims(dims, C, 2 * I, lora->gate_up.rank), lora->workspace, lora->workspace_bytes,
                               stream);
  }
  moe_combine_cuda(dxp, plan.row_of_slot, nullptr, dx, dims.num_tokens, C, dims.top_k, stream);
}

}  // namespace deltamoe
