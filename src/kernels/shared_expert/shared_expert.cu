// Shared expert on the device: cuBLASLt products (the caller's GemmContext) in row-major terms, then
// small fp32 kernels for the SiLU gate, the per-token sigmoid scale and its gradients (ordered
// reductions, no atomics).
#include <algorithm>

#include "core/cuda_check.h"
#include "core/workspace_carver.h"
#include "kernels/gemm/bf16_vector.cuh"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/gemm/f32_operand_cuda.h"
#include "kernels/shared_expert/shared_expert_cuda.h"

namespace deltamoe {

namespace {

using nvbf16 = __nv_bfloat16;

constexpr int kTokensPerChunk = 256;  // rows per partial sum of d_expert_gate

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + __expf(-x)); }

unsigned elementwise_grid(int64_t total) {
  return static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, int64_t{1} << 20));
}

__global__ void swiglu_kernel(const nvbf16* gate, const nvbf16* up, nvbf16* h, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = __bfloat162float(gate[i]);
    h[i] = __float2bfloat16(g * sigmoidf(g) * __bfloat162float(up[i]));
  }
}

// Whether [T, C] rows allow 4-element accesses: C a multiple of 4 and every base 16-byte aligned.
bool four_wide(int64_t hidden, const void* a, const void* b, const void* c = nullptr) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return hidden % 4 == 0 && aligned(a) && aligned(b) && aligned(c);
}

// The per-token kernels below walk rows with blocks (grid-stride) and a row's V-element groups with
// the block's threads: the token's scalar is read once per row and no index is divided (a 64-bit
// division per group held them at ~2-2.6x their memory floor).
unsigned row_grid(int64_t rows) { return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(rows, 132 * 16))); }

// y[t] = (y[t] if accumulate) + sigmoid(logit[t]) out[t]; each thread V adjacent elements of a row.
template <int V>
__global__ void scale_output_kernel(const float* out, const float* logit, nvbf16* y, bool accumulate, int64_t hidden,
                                    int64_t rows) {
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    const float s = sigmoidf(logit[t]);
    for (int64_t i = t * hidden + static_cast<int64_t>(threadIdx.x) * V; i < (t + 1) * hidden;
         i += static_cast<int64_t>(blockDim.x) * V) {
      float value[V], prior[V];
      load_as_f32<V>(out + i, value);
      if (accumulate) load_bf16_as_f32<V>(y + i, prior);
#pragma unroll
      for (int k = 0; k < V; ++k) value[k] = accumulate ? prior[k] + s * value[k] : s * value[k];
      store_f32_as_bf16<V>(y + i, value);
    }
  }
}

// One warp per token t, from u = dy W_down [T, I] (fp32) and the forward's gate, up and logit:
//   h = bf16(silu(g) up), the forward's h bit for bit;  s = sigmoid(logit)
//   d_logit = s (1 - s) (h . u)      (= s (1 - s) (dy . out): out = h W_down^T, so dy . out = h . u)
//   d_h = s u;  d_gate = d_h up silu'(g),  d_up = d_h silu(g)   (in place over gate and up)
//   hs = bf16(s h), the down projection's weight-gradient operand: d_down += dy^T (s h)
// so the backward needs neither the forward's fp32 output nor its down product. Each lane takes V
// adjacent columns at a time (V = 8 when I is a multiple of 8 and the rows 16-byte aligned).
template <int V>
__global__ void gate_backward_kernel(nvbf16* gate_to_dgate, nvbf16* up_to_dup, const float* u, const float* logit,
                                     float* d_logit, nvbf16* hs, int64_t rows, int64_t inter) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= rows) return;
  const float s = sigmoidf(logit[t]);
  nvbf16* g_row = gate_to_dgate + t * inter;
  nvbf16* u_row = up_to_dup + t * inter;
  float dot = 0.0f;
  for (int64_t i = static_cast<int64_t>(lane) * V; i < inter; i += 32 * V) {
    float g[V], up[V], du[V], d_gate[V], d_up[V], h_scaled[V];
    load_bf16_as_f32<V>(g_row + i, g);
    load_bf16_as_f32<V>(u_row + i, up);
    load_as_f32<V>(u + t * inter + i, du);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float sg = sigmoidf(g[k]);
      const float h = __bfloat162float(__float2bfloat16(g[k] * sg * up[k]));
      dot += h * du[k];
      const float d_h = s * du[k];
      d_gate[k] = d_h * up[k] * sg * (1.0f + g[k] * (1.0f - sg));
      d_up[k] = d_h * g[k] * sg;
      h_scaled[k] = s * h;
    }
    store_f32_as_bf16<V>(g_row + i, d_gate);
    store_f32_as_bf16<V>(u_row + i, d_up);
    store_f32_as_bf16<V>(hs + t * inter + i, h_scaled);
  }
#pragma unroll
  for (int d = 16; d > 0; d /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, d);
  if (lane == 0) d_logit[t] = dot * s * (1.0f - s);
}

// d_out = bf16(sigmoid(logit[t]) dy[t]): the output gradient a down-projection adapter's weight
// gradients read.
__global__ void scale_rows_kernel(const nvbf16* dy, const float* logit, nvbf16* d_out, int64_t hidden, int64_t rows) {
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    const float s = sigmoidf(logit[t]);
    for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x)
      d_out[t * hidden + c] = __float2bfloat16(s * __bfloat162float(dy[t * hidden + c]));
  }
}

// dx[t, c] = (dx if accumulate) + dx32[t, c] + d_logit[t] w_gate[c]; V adjacent elements per thread.
template <int V>
__global__ void finish_dx_kernel(const float* dx32, const float* d_logit, const nvbf16* expert_gate, nvbf16* dx,
                                 bool accumulate, int64_t hidden, int64_t rows) {
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    const float dl = d_logit[t];
    for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < hidden; c += static_cast<int64_t>(blockDim.x) * V) {
      const int64_t i = t * hidden + c;
      float value[V], gate[V], prior[V];
      load_as_f32<V>(dx32 + i, value);
      load_bf16_as_f32<V>(expert_gate + c, gate);
      if (accumulate) load_bf16_as_f32<V>(dx + i, prior);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float v = value[k] + dl * gate[k];
        value[k] = accumulate ? prior[k] + v : v;
      }
      store_f32_as_bf16<V>(dx + i, value);
    }
  }
}

// partial[chunk, c] = sum over the chunk's tokens of d_logit[t] x[t, c].
__global__ void gate_grad_partial_kernel(const float* d_logit, const nvbf16* x, float* partial, int64_t num_tokens,
                                         int64_t hidden) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= hidden) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTokensPerChunk;
  const int64_t t1 = min(num_tokens, t0 + kTokensPerChunk);
  float sum = 0;
  for (int64_t t = t0; t < t1; ++t) sum += d_logit[t] * __bfloat162float(x[t * hidden + c]);
  partial[blockIdx.y * hidden + c] = sum;
}

__global__ void gate_grad_reduce_kernel(const float* partial, int chunks, int64_t hidden, float* d_expert_gate) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= hidden) return;
  float sum = 0;
  for (int i = 0; i < chunks; ++i) sum += partial[i * hidden + c];
  d_expert_gate[c] += sum;
}

void check_sizes(const char* where, int64_t num_tokens, int64_t hidden, int64_t intermediate) {
  CHECK(num_tokens >= 0 && hidden >= 1 && intermediate >= 1 && num_tokens < (int64_t{1} << 31) &&
            hidden < (int64_t{1} << 31) && intermediate < (int64_t{1} << 31),
        where, ": bad sizes T=", num_tokens, " C=", hidden, " I=", intermediate);
}

struct ForwardBuffers {
  nvbf16 *gate, *up, *h;
  float *out, *logit;
};

ForwardBuffers take_forward_buffers(WorkspaceCarver& carve, int64_t T, int64_t C, int64_t I) {
  ForwardBuffers b;
  b.gate = carve.take<nvbf16>(T * I);
  b.up = carve.take<nvbf16>(T * I);
  b.h = carve.take<nvbf16>(T * I);
  b.out = carve.take<float>(T * C);
  b.logit = carve.take<float>(T);
  return b;
}

size_t forward_buffer_bytes(int64_t T, int64_t C, int64_t I) {
  return 3 * align256(T * I * sizeof(nvbf16)) + align256(T * C * sizeof(float)) + align256(T * sizeof(float));
}

// The adapters' scratch, carved from SharedExpertLora::scratch.
struct LoraScratch {
  nvbf16 *xa, *dxa, *hi, *lo;
};

LoraScratch lora_scratch(const SharedExpertLora& lora, int64_t T) {
  int64_t rank = 0;
  for (const LoraDeviceAdapter* a : {&lora.gate_proj, &lora.up_proj, &lora.down_proj, &lora.expert_gate})
    if (a->attached()) rank = std::max(rank, a->rank);
  CHECK(lora.gemm != nullptr, "shared_expert: LoRA adapters need a GemmContext");
  CHECK(lora.scratch_bytes >= shared_expert_lora_scratch_bytes(T, rank), "shared_expert: LoRA scratch of ",
        lora.scratch_bytes, " bytes, ", T, " tokens at rank ", rank, " need ", shared_expert_lora_scratch_bytes(T, rank));
  WorkspaceCarver carve("shared_expert", lora.scratch, lora.scratch_bytes);
  LoraScratch s;
  s.xa = carve.take<nvbf16>(T * rank);
  s.dxa = carve.take<nvbf16>(T * rank);
  s.hi = carve.take<nvbf16>(T);
  s.lo = carve.take<nvbf16>(T);
  return s;
}

// The dropout of one adapter of the shared expert (its mask and the shared scratch).
LoraDropoutPass dropout_pass(const SharedExpertLora* lora, const LoraDropoutMask& mask) {
  return LoraDropoutPass{mask, lora->dropout_scratch, lora->dropout_scratch_bytes};
}

// y (+)= the adapter's term s (x' A^T) B^T on top of the base product already in y (x' = dropout(x)).
void lora_forward(const SharedExpertLora* lora, const LoraDeviceAdapter& adapter, const LoraDropoutMask& mask,
                  const nvbf16* x, void* y, DType y_dtype, int64_t T, int64_t in, int64_t out, cudaStream_t stream) {
  if (lora == nullptr || !adapter.attached()) return;
  const LoraScratch s = lora_scratch(*lora, T);
  const LoraDropoutPass dropout = dropout_pass(lora, mask);
  lora_linear_forward_cuda(*lora->gemm, x, adapter, s.xa, y, y_dtype, T, in, out, stream, &dropout);
}

// The adapter's backward for dy [T, out] bf16: dA, dB added to, dx (f32) added to.
void lora_backward(const SharedExpertLora* lora, const LoraDeviceAdapter& adapter, const LoraDropoutMask& mask,
                   const nvbf16* x, const nvbf16* dy, float* dx, int64_t T, int64_t in, int64_t out,
                   cudaStream_t stream) {
  if (lora == nullptr || !adapter.attached()) return;
  const LoraScratch s = lora_scratch(*lora, T);
  const LoraDropoutPass dropout = dropout_pass(lora, mask);
  lora_linear_backward_cuda(*lora->gemm, x, dy, adapter, s.xa, /*recompute_xa=*/true, s.dxa, dx, DType::f32, T, in,
                            out, stream, &dropout);
}

// gate, up and logit = x . w_gate (f32), each product with its adapter's term added: what the
// backward recomputes.
void run_gate_products(GemmContext& gemm, const nvbf16* x, const nvbf16* gate_proj, const nvbf16* up_proj,
                       const nvbf16* expert_gate, const ForwardBuffers& b, int64_t T, int64_t C, int64_t I,
                       cudaStream_t stream, const SharedExpertLora* lora) {
  gemm_bf16_cuda(gemm, false, true, T, I, C, 1.0f, x, C, gate_proj, C, 0.0f, b.gate, DType::bf16, I, stream);
  gemm_bf16_cuda(gemm, false, true, T, I, C, 1.0f, x, C, up_proj, C, 0.0f, b.up, DType::bf16, I, stream);
  gemm_bf16_cuda(gemm, false, true, T, 1, C, 1.0f, x, C, expert_gate, C, 0.0f, b.logit, DType::f32, 1, stream);
  if (lora != nullptr) {
    lora_forward(lora, lora->gate_proj, lora->gate_proj_dropout, x, b.gate, DType::bf16, T, C, I, stream);
    lora_forward(lora, lora->up_proj, lora->up_proj_dropout, x, b.up, DType::bf16, T, C, I, stream);
    lora_forward(lora, lora->expert_gate, lora->expert_gate_dropout, x, b.logit, DType::f32, T, C, 1, stream);
  }
}

// h = silu(gate) up (bf16).
void run_swiglu(const ForwardBuffers& b, int64_t T, int64_t I, cudaStream_t stream) {
  swiglu_kernel<<<elementwise_grid(T * I), 256, 0, stream>>>(b.gate, b.up, b.h, T * I);
  CUDA_CHECK_LAUNCH();
}

// The gate products, h, and out = h W_down^T (f32), each product with its adapter's term added.
void run_forward(GemmContext& gemm, const nvbf16* x, const nvbf16* gate_proj, const nvbf16* up_proj,
                 const nvbf16* down_proj, const nvbf16* expert_gate, const ForwardBuffers& b, int64_t T, int64_t C,
                 int64_t I, cudaStream_t stream, const SharedExpertLora* lora) {
  run_gate_products(gemm, x, gate_proj, up_proj, expert_gate, b, T, C, I, stream, lora);
  run_swiglu(b, T, I, stream);
  gemm_bf16_cuda(gemm, false, true, T, C, I, 1.0f, b.h, I, down_proj, I, 0.0f, b.out, DType::f32, C, stream);
  if (lora != nullptr) lora_forward(lora, lora->down_proj, lora->down_proj_dropout, b.h, b.out, DType::f32, T, I, C, stream);
}

}  // namespace

size_t shared_expert_lora_scratch_bytes(int64_t num_tokens, int64_t rank) {
  return 2 * align256(static_cast<size_t>(num_tokens * rank) * sizeof(nvbf16)) +
         2 * align256(static_cast<size_t>(num_tokens) * sizeof(nvbf16));
}

size_t shared_expert_forward_workspace_bytes(int64_t num_tokens, int64_t hidden, int64_t intermediate) {
  return forward_buffer_bytes(num_tokens, hidden, intermediate);
}

size_t shared_expert_backward_workspace_bytes(int64_t num_tokens, int64_t hidden, int64_t intermediate) {
  const int64_t T = num_tokens, C = hidden, I = intermediate;
  const int64_t chunks = std::max<int64_t>((T + kTokensPerChunk - 1) / kTokensPerChunk, 1);
  return forward_buffer_bytes(T, C, I) + align256(T * C * sizeof(nvbf16)) + align256(T * I * sizeof(float)) +
         align256(T * sizeof(float)) + align256(chunks * C * sizeof(float));
}

void shared_expert_forward_cuda(GemmContext& gemm, const __nv_bfloat16* x, const __nv_bfloat16* gate_proj,
                                const __nv_bfloat16* up_proj, const __nv_bfloat16* down_proj,
                                const __nv_bfloat16* expert_gate, __nv_bfloat16* y, bool accumulate, int64_t num_tokens,
                                int64_t hidden, int64_t intermediate, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream, const SharedExpertLora* lora) {
  check_sizes("shared_expert_forward_cuda", num_tokens, hidden, intermediate);
  if (num_tokens == 0) return;
  const int64_t T = num_tokens, C = hidden, I = intermediate;
  WorkspaceCarver carve("shared_expert", workspace, workspace_bytes);
  const ForwardBuffers b = take_forward_buffers(carve, T, C, I);
  if (lora != nullptr && !lora->any()) lora = nullptr;
  run_forward(gemm, x, gate_proj, up_proj, down_proj, expert_gate, b, T, C, I, stream, lora);
  shared_expert_forward_apply_cuda(SharedExpertPending{b.out, b.logit}, y, accumulate, T, C, stream);
}

SharedExpertPending shared_expert_pending_in(void* memory, size_t bytes, int64_t num_tokens, int64_t hidden) {
  CHECK(num_tokens >= 0 && hidden >= 1, "shared_expert: pending output for T=", num_tokens, " C=", hidden);
  CHECK(memory != nullptr && bytes >= shared_expert_pending_bytes(num_tokens, hidden), "shared_expert: pending output of ",
        bytes, " bytes", memory == nullptr ? " (null)" : "", " for T=", num_tokens, " C=", hidden, ", need ",
        shared_expert_pending_bytes(num_tokens, hidden));
  WorkspaceCarver carve("shared_expert", memory, bytes);
  SharedExpertPending pending;
  pending.out = carve.take<float>(num_tokens * hidden);
  pending.logit = carve.take<float>(num_tokens);
  return pending;
}

void shared_expert_forward_products_cuda(GemmContext& gemm, const __nv_bfloat16* x, const __nv_bfloat16* gate_proj,
                                         const __nv_bfloat16* up_proj, const __nv_bfloat16* down_proj,
                                         const __nv_bfloat16* expert_gate, const SharedExpertPending& pending,
                                         int64_t num_tokens, int64_t hidden, int64_t intermediate, void* workspace,
                                         size_t workspace_bytes, cudaStream_t stream, const SharedExpertLora* lora) {
  check_sizes("shared_expert_forward_products_cuda", num_tokens, hidden, intermediate);
  if (num_tokens == 0) return;
  CHECK(pending.out != nullptr && pending.logit != nullptr, "shared_expert_forward_products_cuda: no pending output");
  const int64_t T = num_tokens, C = hidden, I = intermediate;
  // The same carving as the fused call (out and logit carved but unused), so the products see
  // identically aligned operands.
  WorkspaceCarver carve("shared_expert", workspace, workspace_bytes);
  ForwardBuffers b = take_forward_buffers(carve, T, C, I);
  b.out = pending.out;
  b.logit = pending.logit;
  if (lora != nullptr && !lora->any()) lora = nullptr;
  run_forward(gemm, x, gate_proj, up_proj, down_proj, expert_gate, b, T, C, I, stream, lora);
}

void shared_expert_forward_apply_cuda(const SharedExpertPending& pending, __nv_bfloat16* y, bool accumulate,
                                      int64_t num_tokens, int64_t hidden, cudaStream_t stream) {
  CHECK(num_tokens >= 0 && hidden >= 1, "shared_expert_forward_apply_cuda: bad sizes T=", num_tokens, " C=", hidden);
  if (num_tokens == 0) return;
  const int64_t T = num_tokens, C = hidden;
  if (four_wide(C, pending.out, y))
    scale_output_kernel<4><<<row_grid(T), 256, 0, stream>>>(pending.out, pending.logit, y, accumulate, C, T);
  else
    scale_output_kernel<1><<<row_grid(T), 256, 0, stream>>>(pending.out, pending.logit, y, accumulate, C, T);
  CUDA_CHECK_LAUNCH();
}

void shared_expert_backward_cuda(GemmContext& gemm, const __nv_bfloat16* x, const __nv_bfloat16* gate_proj,
                                 const __nv_bfloat16* up_proj, const __nv_bfloat16* down_proj,
                                 const __nv_bfloat16* expert_gate, const __nv_bfloat16* dy, __nv_bfloat16* dx,
                                 bool accumulate_dx, float* d_gate_proj, float* d_up_proj, float* d_down_proj,
                                 float* d_expert_gate, int64_t num_tokens, int64_t hidden, int64_t intermediate,
                                 void* workspace, size_t workspace_bytes, cudaStream_t stream,
                                 const SharedExpertLora* lora) {
  check_sizes("shared_expert_backward_cuda", num_tokens, hidden, intermediate);
  if (num_tokens == 0) return;
  const int64_t T = num_tokens, C = hidden, I = intermediate;
  WorkspaceCarver carve("shared_expert", workspace, workspace_bytes);
  const ForwardBuffers b = take_forward_buffers(carve, T, C, I);
  nvbf16* d_out = carve.take<nvbf16>(T * C);
  float* d_h = carve.take<float>(T * I);
  float* d_logit = carve.take<float>(T);
  const int64_t chunks = (T + kTokensPerChunk - 1) / kTokensPerChunk;
  float* partial = carve.take<float>(chunks * C);

  if (lora != nullptr && !lora->any()) lora = nullptr;
  // Only the gate products are recomputed: the output gradient's path through the down
  // projection needs u = dy W_down and the forward's h, not the forward's output (gate_backward_kernel).
  run_gate_products(gemm, x, gate_proj, up_proj, expert_gate, b, T, C, I, stream, lora);
  float* u = d_h;
  gemm_bf16_cuda(gemm, false, false, T, I, C, 1.0f, dy, C, down_proj, I, 0.0f, u, DType::f32, I, stream);
  const bool down_adapter = lora != nullptr && lora->down_proj.attached();
  if (down_adapter) {
    // The adapter's share of u, from dy (linear in it); its weight gradients come below from the
    // true output gradient d_out = s dy. Its input h is made here (the kernel below makes s h).
    run_swiglu(b, T, I, stream);
    LoraDeviceAdapter input_only = lora->down_proj;
    input_only.grad_a = input_only.grad_b = nullptr;
    lora_backward(lora, input_only, lora->down_proj_dropout, b.h, dy, u, T, I, C, stream);
  }
  nvbf16* hs = b.h;  // s h replaces h (the adapter is done with it below first)
  if (down_adapter && lora->down_proj.grad_a != nullptr) {
    scale_rows_kernel<<<row_grid(T), 256, 0, stream>>>(dy, b.logit, d_out, C, T);
    CUDA_CHECK_LAUNCH();
    lora_backward(lora, lora->down_proj, lora->down_proj_dropout, b.h, d_out, nullptr, T, I, C, stream);
  }
  const unsigned warps_per_block = 8;
  const auto gate_blocks = static_cast<unsigned>((T + warps_per_block - 1) / warps_per_block);
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (I % 8 == 0 && aligned(b.gate) && aligned(b.up) && aligned(u) && aligned(hs))
    gate_backward_kernel<8><<<gate_blocks, 32 * warps_per_block, 0, stream>>>(b.gate, b.up, u, b.logit, d_logit, hs, T, I);
  else
    gate_backward_kernel<1><<<gate_blocks, 32 * warps_per_block, 0, stream>>>(b.gate, b.up, u, b.logit, d_logit, hs, T, I);
  CUDA_CHECK_LAUNCH();
  // d_down += dy^T (s h).
  if (d_down_proj != nullptr)
    gemm_bf16_cuda(gemm, true, false, C, I, T, 1.0f, dy, C, hs, I, 1.0f, d_down_proj, DType::f32, I, stream);
  const nvbf16* d_gate = b.gate;
  const nvbf16* d_up = b.up;
  // dx32 = d_gate W_gate + d_up W_up (reusing the f32 out buffer), then + d_logit w_gate.
  float* dx32 = b.out;
  gemm_bf16_cuda(gemm, false, false, T, C, I, 1.0f, d_gate, I, gate_proj, C, 0.0f, dx32, DType::f32, C, stream);
  gemm_bf16_cuda(gemm, false, false, T, C, I, 1.0f, d_up, I, up_proj, C, 1.0f, dx32, DType::f32, C, stream);
  if (lora != nullptr) {
    lora_backward(lora, lora->gate_proj, lora->gate_proj_dropout, x, d_gate, dx32, T, C, I, stream);
    lora_backward(lora, lora->up_proj, lora->up_proj_dropout, x, d_up, dx32, T, C, I, stream);
    if (lora->expert_gate.attached()) {
      // The gate logit's gradient is fp32: its adapter's products run once per bf16 half (they are
      // linear in dy), as the router's do.
      const LoraScratch s = lora_scratch(*lora, T);
      split_f32_to_bf16_hi_lo_cuda(d_logit, s.hi, s.lo, T, stream);
      lora_backward(lora, lora->expert_gate, lora->expert_gate_dropout, x, s.hi, dx32, T, C, 1, stream);
      lora_backward(lora, lora->expert_gate, lora->expert_gate_dropout, x, s.lo, dx32, T, C, 1, stream);
    }
  }
  if (four_wide(C, dx32, dx, expert_gate))
    finish_dx_kernel<4><<<row_grid(T), 256, 0, stream>>>(dx32, d_logit, expert_gate, dx, accumulate_dx, C, T);
  else
    finish_dx_kernel<1><<<row_grid(T), 256, 0, stream>>>(dx32, d_logit, expert_gate, dx, accumulate_dx, C, T);
  CUDA_CHECK_LAUNCH();
  // Frozen weights (null gradients) skip their products.
  if (d_gate_proj != nullptr)
    gemm_bf16_cuda(gemm, true, false, I, C, T, 1.0f, d_gate, I, x, C, 1.0f, d_gate_proj, DType::f32, C, stream);
  if (d_up_proj != nullptr)
    gemm_bf16_cuda(gemm, true, false, I, C, T, 1.0f, d_up, I, x, C, 1.0f, d_up_proj, DType::f32, C, stream);
  if (d_expert_gate == nullptr) return;
  const dim3 partial_grid(static_cast<unsigned>((C + 255) / 256), static_cast<unsigned>(chunks));
  gate_grad_partial_kernel<<<partial_grid, 256, 0, stream>>>(d_logit, x, partial, T, C);
  CUDA_CHECK_LAUNCH();
  gate_grad_reduce_kernel<<<static_cast<unsigned>((C + 255) / 256), 256, 0, stream>>>(partial, static_cast<int>(chunks),
                                                                                      C, d_expert_gate);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
