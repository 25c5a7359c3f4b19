// Partial multimodal rotary position embedding (M-RoPE, interleaved sections) as in Qwen3.5:
// only the first R = rotary_dim channels of each head rotate, in "rotate_half" pairs (c, c + R/2);
// frequency j takes its position from the h axis when j % 3 == 1 and j < 3 * section[1], from the
// w axis when j % 3 == 2 and j < 3 * section[2], and from the t axis otherwise.
// Legend: T tokens, H heads, D head dim, R rotary dim (even, <= D).
#pragma once

#include <array>
#include <cstdint>

namespace deltamoe {

struct MropeSpec {
  int64_t rotary_dim = 0;            // R
  std::array<int64_t, 3> section{};  // frequencies per (t, h, w) axis, summing to R / 2
  double theta = 10000.0;            // inv_freq_j = theta^(-2j / R)
};

// Which position axis (0 t, 1 h, 2 w) frequency j in [0, R/2) reads.
int mrope_axis_of_frequency(const MropeSpec& spec, int64_t frequency_idx);

// positions int64 [3, T] (rows t, h, w); cos, sin [T, R/2] written. Angles are formed in T's
// precision (fp32 like transformers for float).
template <typename T>
void mrope_tables_ref(const MropeSpec& spec, const int64_t* positions, int64_t num_tokens, T* cos, T* sin);

// x [T, H, D] -> y [T, H, D] written (channels >= R copied). cos, sin [T, R/2]. y may alias x.
template <typename T>
void mrope_forward_ref(const MropeSpec& spec, const T* x, const T* cos, const T* sin, T* y, int64_t num_tokens,
                       int64_t num_heads, int64_t head_dim);

// dy [T, H, D] -> dx [T, H, D] written (the inverse rotation). dx may alias dy.
template <typename T>
void mrope_backward_ref(const MropeSpec& spec, const T* dy, const T* cos, const T* sin, T* dx, int64_t num_tokens,
                        int64_t num_heads, int64_t head_dim);

}  // namespace deltamoe
