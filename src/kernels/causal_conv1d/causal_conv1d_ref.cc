// CPU reference of the causal depthwise conv1d + SiLU over packed sequences (forward, backward).
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/causal_conv1d/causal_conv1d.h"
#include "kernels/gated_delta_rule/packed_sequences.h"

namespace deltamoe {
namespace {

void check_conv_args(const int32_t* cu_seqlens, int num_seqs, int64_t num_tokens, int num_channels,
                     int kernel_size) {
  CHECK(num_channels > 0, "causal_conv1d: num_channels must be positive, got ", num_channels);
  CHECK(kernel_size > 0, "causal_conv1d: kernel_size must be positive, got ", kernel_size);
  gdn_ref::check_cu_seqlens("causal_conv1d", cu_seqlens, num_seqs, num_tokens);
}

// Pre-activation z[t,c] = sum_j w[c,K-1-j] x[t-j,c] over taps j that stay inside [seq_begin, t].
template <typename S>
S conv_preactivation(const S* x, const S* weight, int64_t seq_begin, int64_t t, int c,
                     int num_channels, int kernel_size) {
  S sum = 0;
  for (int j = 0; j < kernel_size && t - j >= seq_begin; ++j) {
    sum += weight[static_cast<int64_t>(c) * kernel_size + (kernel_size - 1 - j)] *
           x[(t - j) * num_channels + c];
  }
  return sum;
}

template <typename S>
S sigmoid(S z) {
  return S(1) / (S(1) + std::exp(-z));
}

}  // namespace

template <typename S>
void causal_conv1d_forward_ref(const S* x, const S* weight, const int32_t* cu_seqlens, int num_seqs,
                               int64_t num_tokens, int num_channels, int kernel_size, S* y) {
  check_conv_args(cu_seqlens, num_seqs, num_tokens, num_channels, kernel_size);
  for (int n = 0; n < num_seqs; ++n) {
    const int64_t seq_begin = cu_seqlens[n];
    for (int64_t t = seq_begin; t < cu_seqlens[n + 1]; ++t) {
      for (int c = 0; c < num_channels; ++c) {
        const S z = conv_preactivation(x, weight, seq_begin, t, c, num_channels, kernel_size);
        y[t * num_channels + c] = z * sigmoid(z);
      }
    }
  }
}

template <typename S>
void causal_conv1d_backward_ref(const S* x, const S* weight, const S* dy, const int32_t* cu_seqlens,
                                int num_seqs, int64_t num_tokens, int num_channels, int kernel_size,
                                S* dx, S* dweight) {
  check_conv_args(cu_seqlens, num_seqs, num_tokens, num_channels, kernel_size);
  for (int64_t i = 0; i < num_tokens * num_channels; ++i) dx[i] = 0;
  for (int n = 0; n < num_seqs; ++n) {
    const int64_t seq_begin = cu_seqlens[n];
    for (int64_t t = seq_begin; t < cu_seqlens[n + 1]; ++t) {
      for (int c = 0; c < num_channels; ++c) {
        const S z = conv_preactivation(x, weight, seq_begin, t, c, num_channels, kernel_size);
        // d silu(z)/dz = s (1 + z (1 - s)) with s = sigmoid(z).
        const S s = sigmoid(z);
        const S dz = dy[t * num_channels + c] * s * (S(1) + z * (S(1) - s));
        // Scatter dz back along the same taps the forward read.
        for (int j = 0; j < kernel_size && t - j >= seq_begin; ++j) {
          const int64_t w_idx = static_cast<int64_t>(c) * kernel_size + (kernel_size - 1 - j);
          dx[(t - j) * num_channels + c] += weight[w_idx] * dz;
          if (dweight != nullptr) dweight[w_idx] += x[(t - j) * num_channels + c] * dz;
        }
      }
    }
  }
}

template void causal_conv1d_forward_ref<float>(const float*, const float*, const int32_t*, int,
                                               int64_t, int, int, float*);
template void causal_conv1d_forward_ref<double>(const double*, const double*, const int32_t*, int,
                                                int64_t, int, int, double*);
template void causal_conv1d_backward_ref<float>(const float*, const float*, const float*,
                                                const int32_t*, int, int64_t, int, int, float*,
                                                float*);
template void causal_conv1d_backward_ref<double>(const double*, const double*, const double*,
                                                 const int32_t*, int, int64_t, int, int, double*,
                                                 double*);

}  // namespace deltamoe
