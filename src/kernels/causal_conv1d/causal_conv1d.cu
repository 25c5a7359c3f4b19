// CUDA kernels of the causal depthwise conv1d + SiLU over packed sequences, forward and backward.
// Each thread owns V adjacent channels (one 16- or 8-byte access per token) and walks a strip of
// tokens in order, keeping the taps, the last K-1 inputs and (backward) the last K pre-activation
// gradients in registers: every x and dy element is read once per strip (plus a K-1 token halo),
// every y / dx element written once. Sequence starts are found once per strip and then tracked
// while walking. Loads are issued kChunk tokens at a time, the next chunk's before the current one
// is computed, so that each thread keeps several in flight.
#include <algorithm>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/causal_conv1d/causal_conv1d_cuda.h"

namespace deltamoe {
namespace {

constexpr int kThreads = 128;
constexpr int kForwardStrip = 32;   // tokens per thread in the forward
constexpr int kBackwardStrip = 64;  // in the backward (its halo is 2 (K-1) tokens)
constexpr int kChunk = 4;           // tokens whose loads are issued together
constexpr int kForwardVector = 8;   // channels per thread when the layout allows (16-byte accesses)
constexpr int kBackwardVector = 4;  // (8-byte accesses: the backward holds twice the registers)

__device__ inline float sigmoid_f(float z) { return 1.0f / (1.0f + __expf(-z)); }

// V bf16 values as one access.
template <int V> struct Raw;
template <> struct Raw<8> { using type = uint4; };
template <> struct Raw<4> { using type = uint2; };
template <> struct Raw<1> { using type = __nv_bfloat16; };

template <int V>
__device__ inline typename Raw<V>::type load_raw(const __nv_bfloat16* p) {
  return *reinterpret_cast<const typename Raw<V>::type*>(p);
}

template <int V>
__device__ inline void unpack(const typename Raw<V>::type& raw, float* out) {
  if constexpr (V == 1) {
    out[0] = __bfloat162float(raw);
  } else {
    const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < V / 2; ++i) {
      const float2 f = __bfloat1622float2(pairs[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
}

template <int V>
__device__ inline void store(__nv_bfloat16* p, const float* v) {
  if constexpr (V == 1) {
    *p = __float2bfloat16(v[0]);
  } else {
    typename Raw<V>::type raw;
    auto* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < V / 2; ++i) pairs[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<typename Raw<V>::type*>(p) = raw;
  }
}

// The column parts as the kernels see them: cumulative ends instead of widths.
template <typename Element>
struct Parts {
  Element* part[3];
  int64_t end[3];
};

template <typename Element>
Parts<Element> parts_of(const CausalConv1dColumns<Element>& columns) {
  Parts<Element> p{};
  int64_t end = 0;
  for (int i = 0; i < 3; ++i) {
    end += columns.width[i];
    p.part[i] = columns.part[i];
    p.end[i] = end;
  }
  return p;
}

// Where channel c0's values live: the base pointer (row 0, channel c0) and the row stride.
template <typename Element>
__device__ inline Element* column_base(const Parts<Element>& parts, int c0, int64_t* stride) {
  const int i = c0 < parts.end[0] ? 0 : (c0 < parts.end[1] ? 1 : 2);
  const int64_t begin = i == 0 ? 0 : (i == 1 ? parts.end[0] : parts.end[1]);
  Element* base = i == 0 ? parts.part[0] : (i == 1 ? parts.part[1] : parts.part[2]);
  *stride = (i == 0 ? parts.end[0] : (i == 1 ? parts.end[1] : parts.end[2])) - begin;
  return base + (c0 - begin);
}

// Index of the sequence that holds token t: the largest n < N with cu_seqlens[n] <= t (past any
// empty sequences that start at the same offset).
__device__ inline int sequence_of(const int32_t* cu_seqlens, int num_seqs, int64_t t) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_seqlens[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// tap[j][v] = weight[c0 + v, K-1-j]: the weight that multiplies the token j steps back.
template <int K, int V>
__device__ inline void load_taps(const __nv_bfloat16* weight, int c0, float (&tap)[K][V]) {
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int j = 0; j < K; ++j) tap[j][v] = __bfloat162float(weight[(c0 + v) * K + K - 1 - j]);
}

// win[j-1] = x[t0 - j] for the K-1 tokens before the strip, zero before t0's sequence start.
template <int K, int V>
__device__ inline void load_history(const __nv_bfloat16* x, int64_t num_channels, int c0, int64_t t0,
                                    int64_t seq_begin, float (&win)[K][V]) {
#pragma unroll
  for (int j = 1; j < K; ++j) {
    const int64_t t = t0 - j;
    if (t >= seq_begin) {
      unpack<V>(load_raw<V>(x + t * num_channels + c0), win[j - 1]);
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) win[j - 1][v] = 0.0f;
    }
  }
}

// z = sum_j tap[j] x[t-j] with x[t] = xt and x[t-j] = win[j-1].
template <int K, int V>
__device__ inline void preactivation(const float (&tap)[K][V], const float* xt, const float (&win)[K][V],
                                     float* z) {
#pragma unroll
  for (int v = 0; v < V; ++v) {
    float sum = tap[0][v] * xt[v];
#pragma unroll
    for (int j = 1; j < K; ++j) sum += tap[j][v] * win[j - 1][v];
    z[v] = sum;
  }
}

// win <- (xt, win[0], ..., win[K-3]).
template <int K, int V>
__device__ inline void push_history(const float* xt, float (&win)[K][V]) {
#pragma unroll
  for (int j = K - 2; j >= 1; --j)
#pragma unroll
    for (int v = 0; v < V; ++v) win[j][v] = win[j - 1][v];
  if constexpr (K > 1) {
#pragma unroll
    for (int v = 0; v < V; ++v) win[0][v] = xt[v];
  }
}

template <int K, int V>
__global__ void __launch_bounds__(kThreads) conv_forward_kernel(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                                                const int32_t* cu_seqlens, int num_seqs,
                                                                int64_t num_tokens, int num_channels,
                                                                Parts<__nv_bfloat16> y) {
  const int c0 = (blockIdx.x * kThreads + threadIdx.x) * V;
  if (c0 >= num_channels) return;
  float tap[K][V];
  load_taps<K, V>(weight, c0, tap);
  int64_t y_stride;
  __nv_bfloat16* y_base = column_base(y, c0, &y_stride);
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kForwardStrip;
  const int64_t t1 = min(num_tokens, t0 + kForwardStrip);
  int n = sequence_of(cu_seqlens, num_seqs, t0);
  int64_t next = cu_seqlens[n + 1];
  float win[K][V];  // win[j-1] = x[t-j] (K-1 rows used)
  load_history<K, V>(x, num_channels, c0, t0, cu_seqlens[n], win);
  // raw holds the chunk being computed, next the following one, loaded before raw is used.
  typename Raw<V>::type raw[kChunk], next_raw[kChunk];
#pragma unroll
  for (int u = 0; u < kChunk; ++u)
    if (t0 + u < t1) raw[u] = load_raw<V>(x + (t0 + u) * num_channels + c0);
  for (int64_t tc = t0; tc < t1; tc += kChunk) {
#pragma unroll
    for (int u = 0; u < kChunk; ++u)
      if (tc + kChunk + u < t1) next_raw[u] = load_raw<V>(x + (tc + kChunk + u) * num_channels + c0);
#pragma unroll
    for (int u = 0; u < kChunk; ++u) {
      const int64_t t = tc + u;
      if (t >= t1) break;
      if (t >= next) {  // t starts a sequence: no tap reaches the previous one
        while (cu_seqlens[n + 1] <= t) ++n;
        next = cu_seqlens[n + 1];
#pragma unroll
        for (int j = 0; j < K; ++j)
#pragma unroll
          for (int v = 0; v < V; ++v) win[j][v] = 0.0f;
      }
      float xt[V], z[V];
      unpack<V>(raw[u], xt);
      preactivation<K, V>(tap, xt, win, z);
#pragma unroll
      for (int v = 0; v < V; ++v) z[v] = z[v] * sigmoid_f(z[v]);
      store<V>(y_base + t * y_stride, z);
      push_history<K, V>(xt, win);
    }
#pragma unroll
    for (int u = 0; u < kChunk; ++u) raw[u] = next_raw[u];
  }
}

// Walks positions p = t0 .. t1 + K - 2: dz[p] = dy[p] silu'(z[p]) (zero past T), d tap[j] +=
// x[p-j] dz[p] for p inside the strip, and once dz[q .. q+K-1] are known (q = p - K + 1),
// dx[q] = sum_j tap[j] dz[q+j] over the q+j in q's sequence. The strip's weight-gradient sums go to
// its row of strip_dweight [strips, C, K] (null: frozen weight, not formed).
template <int K, int V>
__global__ void __launch_bounds__(kThreads) conv_backward_kernel(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                                                 Parts<const __nv_bfloat16> dy,
                                                                 const int32_t* cu_seqlens, int num_seqs,
                                                                 int64_t num_tokens, int num_channels,
                                                                 __nv_bfloat16* dx, float* strip_dweight) {
  const int c0 = (blockIdx.x * kThreads + threadIdx.x) * V;
  if (c0 >= num_channels) return;
  float tap[K][V], d_tap[K][V];
  load_taps<K, V>(weight, c0, tap);
#pragma unroll
  for (int j = 0; j < K; ++j)
#pragma unroll
    for (int v = 0; v < V; ++v) d_tap[j][v] = 0.0f;
  int64_t dy_stride;
  const __nv_bfloat16* dy_base = column_base(dy, c0, &dy_stride);
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kBackwardStrip;
  const int64_t t1 = min(num_tokens, t0 + kBackwardStrip);
  const int64_t p_stop = t1 + K - 1;                 // positions walked: [t0, p_stop)
  const int64_t p_real = min(num_tokens, p_stop);    // positions with tokens: [t0, p_real)
  int n = sequence_of(cu_seqlens, num_seqs, t0);
  int64_t next = cu_seqlens[n + 1];
  float win[K][V];
  load_history<K, V>(x, num_channels, c0, t0, cu_seqlens[n], win);
  float dz_win[K][V];  // dz_win[j] = dz[p-j]
  int seq_win[K];      // the sequence of p-j (-1: past the last token)
#pragma unroll
  for (int j = 0; j < K; ++j) {
    seq_win[j] = -1;
#pragma unroll
    for (int v = 0; v < V; ++v) dz_win[j][v] = 0.0f;
  }
  // raw_* hold the chunk being computed, next_* the following one, loaded before raw_* are used.
  typename Raw<V>::type raw_x[kChunk], raw_dy[kChunk], next_x[kChunk], next_dy[kChunk];
#pragma unroll
  for (int u = 0; u < kChunk; ++u) {
    if (t0 + u < p_real) {
      raw_x[u] = load_raw<V>(x + (t0 + u) * num_channels + c0);
      raw_dy[u] = load_raw<V>(dy_base + (t0 + u) * dy_stride);
    }
  }
  for (int64_t pc = t0; pc < p_stop; pc += kChunk) {
#pragma unroll
    for (int u = 0; u < kChunk; ++u) {
      if (pc + kChunk + u < p_real) {
        next_x[u] = load_raw<V>(x + (pc + kChunk + u) * num_channels + c0);
        next_dy[u] = load_raw<V>(dy_base + (pc + kChunk + u) * dy_stride);
      }
    }
#pragma unroll
    for (int u = 0; u < kChunk; ++u) {
      const int64_t p = pc + u;
      if (p >= p_stop) break;
      float dz[V];
      int seq = -1;
      if (p < p_real) {
        if (p >= next) {
          while (cu_seqlens[n + 1] <= p) ++n;
          next = cu_seqlens[n + 1];
#pragma unroll
          for (int j = 0; j < K; ++j)
#pragma unroll
            for (int v = 0; v < V; ++v) win[j][v] = 0.0f;
        }
        seq = n;
        float xt[V], z[V], g[V];
        unpack<V>(raw_x[u], xt);
        unpack<V>(raw_dy[u], g);
        preactivation<K, V>(tap, xt, win, z);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const float s = sigmoid_f(z[v]);
          dz[v] = g[v] * s * (1.0f + z[v] * (1.0f - s));
        }
        if (p < t1) {
#pragma unroll
          for (int v = 0; v < V; ++v) {
            d_tap[0][v] += xt[v] * dz[v];
#pragma unroll
            for (int j = 1; j < K; ++j) d_tap[j][v] += win[j - 1][v] * dz[v];
          }
        }
        push_history<K, V>(xt, win);
      } else {
#pragma unroll
        for (int v = 0; v < V; ++v) dz[v] = 0.0f;
      }
#pragma unroll
      for (int j = K - 1; j >= 1; --j) {
        seq_win[j] = seq_win[j - 1];
#pragma unroll
        for (int v = 0; v < V; ++v) dz_win[j][v] = dz_win[j - 1][v];
      }
      seq_win[0] = seq;
#pragma unroll
      for (int v = 0; v < V; ++v) dz_win[0][v] = dz[v];
      const int64_t q = p - (K - 1);
      if (q >= t0) {
        // dz[q + j] = dz_win[K-1-j]; q's own sequence is seq_win[K-1].
        float out[V];
#pragma unroll
        for (int v = 0; v < V; ++v) out[v] = 0.0f;
#pragma unroll
        for (int j = 0; j < K; ++j) {
          if (seq_win[K - 1 - j] == seq_win[K - 1]) {
#pragma unroll
            for (int v = 0; v < V; ++v) out[v] += tap[j][v] * dz_win[K - 1 - j][v];
          }
        }
        store<V>(dx + q * num_channels + c0, out);
      }
    }
#pragma unroll
    for (int u = 0; u < kChunk; ++u) {
      raw_x[u] = next_x[u];
      raw_dy[u] = next_dy[u];
    }
  }
  if (strip_dweight == nullptr) return;
  float* mine = strip_dweight + static_cast<int64_t>(blockIdx.y) * num_channels * K + static_cast<int64_t>(c0) * K;
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int j = 0; j < K; ++j) mine[v * K + K - 1 - j] = d_tap[j][v];
}

// dweight[i] += the strips' partial sums, in strip order (the same bits on every run).
__global__ void conv_dweight_reduce_kernel(const float* strip_dweight, int64_t num_strips, int64_t count,
                                           float* dweight) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= count) return;
  float sum = 0.0f;
  for (int64_t s = 0; s < num_strips; ++s) sum += strip_dweight[s * count + i];
  dweight[i] += sum;
}

template <typename Element>
void check_columns(const CausalConv1dColumns<Element>& columns, int num_channels, const char* what) {
  int64_t total = 0;
  for (int i = 0; i < 3; ++i) {
    CHECK(columns.width[i] >= 0, "causal_conv1d_cuda: ", what, " part ", i, " has negative width ",
          columns.width[i]);
    CHECK(columns.width[i] == 0 || columns.part[i] != nullptr, "causal_conv1d_cuda: ", what, " part ", i,
          " of width ", columns.width[i], " has no pointer");
    total += columns.width[i];
  }
  CHECK(total == num_channels, "causal_conv1d_cuda: the ", what, " parts' widths sum to ", total, ", not to the ",
        num_channels, " channels");
}

// Whether V-channel accesses are aligned everywhere: every part starts on a V-element boundary.
template <typename Element>
bool columns_allow(const CausalConv1dColumns<Element>& columns, int v) {
  for (int i = 0; i < 3; ++i) {
    if (columns.width[i] % v != 0) return false;
    if (reinterpret_cast<uintptr_t>(columns.part[i]) % (static_cast<uintptr_t>(v) * 2) != 0) return false;
  }
  return true;
}

bool aligned(const void* p, int v) { return reinterpret_cast<uintptr_t>(p) % (static_cast<uintptr_t>(v) * 2) == 0; }

void check_conv_launch(int num_seqs, int64_t num_tokens, int num_channels, int kernel_size) {
  CHECK(num_seqs >= 1, "causal_conv1d_cuda: need at least one sequence, got ", num_seqs);
  CHECK(num_tokens >= 0, "causal_conv1d_cuda: num_tokens must not be negative, got ", num_tokens);
  CHECK(num_channels > 0, "causal_conv1d_cuda: num_channels must be positive, got ",
        num_channels);
  CHECK(kernel_size > 0 && kernel_size <= kCausalConv1dMaxKernel,
        "causal_conv1d_cuda: kernel_size must be in [1, ", kCausalConv1dMaxKernel, "], got ",
        kernel_size);
  CHECK((num_tokens + kForwardStrip - 1) / kForwardStrip <= 65535,
        "causal_conv1d_cuda: too many tokens for one launch: ", num_tokens);
}

dim3 conv_grid(int64_t num_tokens, int num_channels, int vector, int strip) {
  const int64_t threads = (num_channels + vector - 1) / vector;
  return dim3(static_cast<unsigned>((threads + kThreads - 1) / kThreads),
              static_cast<unsigned>((num_tokens + strip - 1) / strip));
}

template <int K, int V>
void launch_forward(const __nv_bfloat16* x, const __nv_bfloat16* weight, const int32_t* cu_seqlens, int num_seqs,
                    int64_t num_tokens, int num_channels, const Parts<__nv_bfloat16>& y, cudaStream_t stream) {
  conv_forward_kernel<K, V><<<conv_grid(num_tokens, num_channels, V, kForwardStrip), kThreads, 0, stream>>>(
      x, weight, cu_seqlens, num_seqs, num_tokens, num_channels, y);
}

template <int K, int V>
void launch_backward(const __nv_bfloat16* x, const __nv_bfloat16* weight, const Parts<const __nv_bfloat16>& dy,
                     const int32_t* cu_seqlens, int num_seqs, int64_t num_tokens, int num_channels,
                     __nv_bfloat16* dx, float* strip_dweight, cudaStream_t stream) {
  conv_backward_kernel<K, V><<<conv_grid(num_tokens, num_channels, V, kBackwardStrip), kThreads, 0, stream>>>(
      x, weight, dy, cu_seqlens, num_seqs, num_tokens, num_channels, dx, strip_dweight);
}

// Calls f.template operator()<K>() for the runtime kernel size (checked to be in [1, 8]).
template <typename F>
void with_kernel_size(int kernel_size, F&& f) {
  switch (kernel_size) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    case 4: f.template operator()<4>(); break;
    case 5: f.template operator()<5>(); break;
    case 6: f.template operator()<6>(); break;
    case 7: f.template operator()<7>(); break;
    default: f.template operator()<8>(); break;
  }
}

}  // namespace

void causal_conv1d_forward_cuda(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                const int32_t* cu_seqlens, int num_seqs, int64_t num_tokens,
                                int num_channels, int kernel_size, const CausalConv1dOutput& y,
                                cudaStream_t stream) {
  check_conv_launch(num_seqs, num_tokens, num_channels, kernel_size);
  check_columns(y, num_channels, "y");
  if (num_tokens == 0) return;
  const Parts<__nv_bfloat16> parts = parts_of(y);
  const bool wide = num_channels % kForwardVector == 0 && aligned(x, kForwardVector) &&
                    columns_allow(y, kForwardVector);
  with_kernel_size(kernel_size, [&]<int K>() {
    if (wide) {
      launch_forward<K, kForwardVector>(x, weight, cu_seqlens, num_seqs, num_tokens, num_channels, parts, stream);
    } else {
      launch_forward<K, 1>(x, weight, cu_seqlens, num_seqs, num_tokens, num_channels, parts, stream);
    }
  });
  CUDA_CHECK_LAUNCH();
}

size_t causal_conv1d_backward_workspace_bytes(int64_t num_tokens, int num_channels, int kernel_size) {
  const int64_t strips = std::max<int64_t>((num_tokens + kBackwardStrip - 1) / kBackwardStrip, 1);
  return static_cast<size_t>(strips) * static_cast<size_t>(num_channels) * static_cast<size_t>(kernel_size) *
         sizeof(float);
}

void causal_conv1d_backward_cuda(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                 const CausalConv1dOutputGrad& dy, const int32_t* cu_seqlens, int num_seqs,
                                 int64_t num_tokens, int num_channels, int kernel_size,
                                 __nv_bfloat16* dx, float* dweight, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream) {
  check_conv_launch(num_seqs, num_tokens, num_channels, kernel_size);
  check_columns(dy, num_channels, "dy");
  const size_t needed = dweight != nullptr ? causal_conv1d_backward_workspace_bytes(num_tokens, num_channels,
                                                                                    kernel_size)
                                           : 0;
  CHECK(workspace_bytes >= needed, "causal_conv1d_backward_cuda: workspace of ", workspace_bytes, " bytes, needs ",
        needed);
  if (num_tokens == 0) return;
  float* strip_dweight = dweight != nullptr ? static_cast<float*>(workspace) : nullptr;
  const Parts<const __nv_bfloat16> parts = parts_of(dy);
  const bool wide = num_channels % kBackwardVector == 0 && aligned(x, kBackwardVector) &&
                    aligned(dx, kBackwardVector) && columns_allow(dy, kBackwardVector);
  with_kernel_size(kernel_size, [&]<int K>() {
    if (wide) {
      launch_backward<K, kBackwardVector>(x, weight, parts, cu_seqlens, num_seqs, num_tokens, num_channels, dx,
                                          strip_dweight, stream);
    } else {
      launch_backward<K, 1>(x, weight, parts, cu_seqlens, num_seqs, num_tokens, num_channels, dx, strip_dweight,
                            stream);
    }
  });
  CUDA_CHECK_LAUNCH();
  if (dweight == nullptr) return;
  const int64_t strips = (num_tokens + kBackwardStrip - 1) / kBackwardStrip;
  const int64_t count = static_cast<int64_t>(num_channels) * kernel_size;
  conv_dweight_reduce_kernel<<<static_cast<unsigned>((count + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      strip_dweight, strips, count, dweight);
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
