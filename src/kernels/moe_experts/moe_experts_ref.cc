// Plain CPU reference of the routed SiLU-gated experts (fused gate_up layout) and their gradients.
#include "kernels/moe_experts/moe_experts.h"

#include <cmath>
#include <vector>

#include "core/error.h"

namespace deltamoe {

namespace {

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

int64_t checked_expert(const MoeExpertsDims& dims, const int32_t* topk_idx, int64_t t, int64_t slot) {
  const int64_t e = topk_idx[t * dims.top_k + slot];
  CHECK(e >= 0 && e < dims.num_experts, "moe_experts: token ", t, " slot ", slot, " routes to expert ", e,
        ", outside [0, ", dims.num_experts, ")");
  return e;
}

// gu = gate_up[e] x for one token: [2I].
template <typename T>
void expert_gate_up(const MoeExpertsDims& dims, const T* x_row, const T* gate_up, int64_t e, std::vector<T>& gu) {
  const int64_t C = dims.hidden, I2 = 2 * dims.intermediate;
  const T* w = gate_up + e * I2 * C;
  for (int64_t n = 0; n < I2; ++n) {
    T sum = 0;
    for (int64_t c = 0; c < C; ++c) sum += w[n * C + c] * x_row[c];
    gu[n] = sum;
  }
}

}  // namespace

template <typename T>
void moe_expert_row_forward_ref(const MoeExpertsDims& dims, const T* x_row, int64_t e, const T* gate_up,
                                const T* down, T* y_e, MoeExpertRowScratch<T>& scratch) {
  const int64_t C = dims.hidden, I = dims.intermediate;
  scratch.gu.resize(2 * I);
  scratch.h.resize(I);
  std::vector<T>& gu = scratch.gu;
  std::vector<T>& h = scratch.h;
  expert_gate_up(dims, x_row, gate_up, e, gu);
  for (int64_t i = 0; i < I; ++i) h[i] = gu[i] * sigmoid(gu[i]) * gu[I + i];
  const T* w_down = down + e * C * I;
  for (int64_t c = 0; c < C; ++c) {
    T sum = 0;
    for (int64_t i = 0; i < I; ++i) sum += w_down[c * I + i] * h[i];
    y_e[c] = sum;
  }
}

template <typename T>
void moe_expert_row_backward_ref(const MoeExpertsDims& dims, const T* x_row, int64_t e, T weight, const T* dy_row,
                                 const T* gate_up, const T* down, T* dx_row, T* d_weight_out, T* d_gate_up,
                                 T* d_down, MoeExpertRowScratch<T>& scratch) {
  const int64_t C = dims.hidden, I = dims.intermediate;
  scratch.gu.resize(2 * I);
  scratch.h.resize(I);
  scratch.dh.resize(I);
  scratch.d_gu.resize(2 * I);
  std::vector<T>& gu = scratch.gu;
  std::vector<T>& h = scratch.h;
  std::vector<T>& dh = scratch.dh;
  std::vector<T>& d_gu = scratch.d_gu;
  expert_gate_up(dims, x_row, gate_up, e, gu);
  for (int64_t i = 0; i < I; ++i) h[i] = gu[i] * sigmoid(gu[i]) * gu[I + i];
  const T* w_down = down + e * C * I;
  T* dw_down = d_down != nullptr ? d_down + e * C * I : nullptr;
  // d weight = dy . y_e; d y_e = weight * dy.
  T d_weight = 0;
  for (int64_t i = 0; i < I; ++i) dh[i] = 0;
  for (int64_t c = 0; c < C; ++c) {
    T y_c = 0;
    for (int64_t i = 0; i < I; ++i) y_c += w_down[c * I + i] * h[i];
    d_weight += dy_row[c] * y_c;
    const T dy_e = weight * dy_row[c];
    if (dw_down != nullptr) {
      for (int64_t i = 0; i < I; ++i) dw_down[c * I + i] += dy_e * h[i];
    }
    for (int64_t i = 0; i < I; ++i) dh[i] += dy_e * w_down[c * I + i];
  }
  *d_weight_out = d_weight;
  // h = silu(g) * u: dg = dh * u * silu'(g), du = dh * silu(g); silu'(g) = s (1 + g (1 - s)).
  for (int64_t i = 0; i < I; ++i) {
    const T g = gu[i], u = gu[I + i], s = sigmoid(g);
    d_gu[i] = dh[i] * u * s * (T(1) + g * (T(1) - s));
    d_gu[I + i] = dh[i] * g * s;
  }
  const T* w_gu = gate_up + e * 2 * I * C;
  T* dw_gu = d_gate_up != nullptr ? d_gate_up + e * 2 * I * C : nullptr;
  for (int64_t c = 0; c < C; ++c) dx_row[c] = 0;
  for (int64_t n = 0; n < 2 * I; ++n) {
    if (dw_gu != nullptr) {
      for (int64_t c = 0; c < C; ++c) dw_gu[n * C + c] += d_gu[n] * x_row[c];
    }
    for (int64_t c = 0; c < C; ++c) dx_row[c] += d_gu[n] * w_gu[n * C + c];
  }
}

template <typename T>
void moe_experts_forward_ref(const MoeExpertsDims& dims, const T* x, const int32_t* topk_idx, const T* topk_weight,
                             const T* gate_up, const T* down, T* y) {
  const int64_t C = dims.hidden;
  MoeExpertRowScratch<T> scratch;
  std::vector<T> y_e(C);
  for (int64_t t = 0; t < dims.num_tokens; ++t) {
    T* y_row = y + t * C;
    for (int64_t c = 0; c < C; ++c) y_row[c] = 0;
    for (int64_t slot = 0; slot < dims.top_k; ++slot) {
      const int64_t e = checked_expert(dims, topk_idx, t, slot);
      moe_expert_row_forward_ref(dims, x + t * C, e, gate_up, down, y_e.data(), scratch);
      const T weight = topk_weight[t * dims.top_k + slot];
      for (int64_t c = 0; c < C; ++c) y_row[c] += weight * y_e[c];
    }
  }
}

template <typename T>
void moe_experts_backward_ref(const MoeExpertsDims& dims, const T* x, const int32_t* topk_idx, const T* topk_weight,
                              const T* gate_up, const T* down, const T* dy, T* dx, T* d_topk_weight, T* d_gate_up,
                              T* d_down) {
  const int64_t C = dims.hidden;
  MoeExpertRowScratch<T> scratch;
  std::vector<T> dx_slot(C);
  for (int64_t t = 0; t < dims.num_tokens; ++t) {
    T* dx_row = dx + t * C;
    for (int64_t c = 0; c < C; ++c) dx_row[c] = 0;
    for (int64_t slot = 0; slot < dims.top_k; ++slot) {
      const int64_t e = checked_expert(dims, topk_idx, t, slot);
      moe_expert_row_backward_ref(dims, x + t * C, e, topk_weight[t * dims.top_k + slot], dy + t * C, gate_up, down,
                                  dx_slot.data(), &d_topk_weight[t * dims.top_k + slot], d_gate_up, d_down, scratch);
      for (int64_t c = 0; c < C; ++c) dx_row[c] += dx_slot[c];
    }
  }
}

#define INSTANTIATE(T)                                                                                           \
  template void moe_experts_forward_ref<T>(const MoeExpertsDims&, const T*, const int32_t*, const T*, const T*,  \
                                           const T*, T*);                                                        \
  template void moe_experts_backward_ref<T>(const MoeExpertsDims&, const T*, const int32_t*, const T*, const T*, \
                                            const T*, const T*, T*, T*, T*, T*);                                 \
  template void moe_expert_row_forward_ref<T>(const MoeExpertsDims&, const T*, int64_t, const T*, const T*, T*, \
                                              MoeExpertRowScratch<T>&);                                          \
  template void moe_expert_row_backward_ref<T>(const MoeExpertsDims&, const T*, int64_t, T, const T*, const T*,  \
                                               const T*, T*, T*, T*, T*, MoeExpertRowScratch<T>&);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace deltamoe
