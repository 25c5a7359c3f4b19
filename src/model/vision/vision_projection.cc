// Vision projections with an optional LoRA adapter (see vision_projection.h).
#include "model/vision/vision_projection.h"

#include <vector>

#include "core/error.h"
#include "kernels/bias_add/bias_add.h"
#include "kernels/linear/linear.h"
#include "model/lora/lora_dropout.h"

namespace deltamoe {

namespace {

template <typename T>
struct VisionAdapter {
  const T* a = nullptr;
  const T* b = nullptr;
  int64_t rank = 0;
  T scaling = 0;
  LoraDropoutMask dropout;  // of the open training pass (model/lora/lora_dropout.h); inactive: none
};

// The adapter of module, or rank 0 when it has none.
template <typename T>
VisionAdapter<T> vision_adapter(const VisionParams& params, const std::string& module, int64_t in_features,
                                int64_t out_features) {
  VisionAdapter<T> adapter;
  auto a = params.find(module + ".lora_A.weight");
  if (a == params.end()) return adapter;
  CHECK(a->second.shape().rank() == 2 && a->second.shape()[1] == in_features, "LoRA: '", module,
        ".lora_A.weight' must be [r, ", in_features, "], got ", a->second.shape().str());
  adapter.rank = a->second.shape()[0];
  adapter.a = vision_param<T>(params, module + ".lora_A.weight", adapter.rank * in_features);
  adapter.b = vision_param<T>(params, module + ".lora_B.weight", out_features * adapter.rank);
  adapter.scaling = *vision_param<T>(params, module + ".lora_scaling", 1);
  if (params.find(module + ".lora_index") != params.end()) {
    adapter.dropout = lora_dropout_for(static_cast<int64_t>(*vision_param<T>(params, module + ".lora_index", 1)));
  }
  return adapter;
}

// x itself, or dropout(x) in *storage when the mask is active (rows 0 .. rows - 1 of the mask).
template <typename T>
const T* dropped_input(const LoraDropoutMask& mask, const T* x, int64_t rows, int64_t cols, std::vector<T>* storage) {
  if (!mask.active()) return x;
  storage->resize(rows * cols);
  lora_dropout_apply_ref(mask, x, storage->data(), rows, cols);
  return storage->data();
}

}  // namespace

template <typename T>
T* optional_vision_grad(VisionParams* grads, const std::string& name, int64_t numel) {
  if (grads == nullptr || grads->find(name) == grads->end()) return nullptr;
  return vision_param<T>(*grads, name, numel);
}

template <typename T>
void vision_project_forward(const VisionParams& params, const std::string& module, const T* x, T* y, int64_t rows,
                            int64_t in_features, int64_t out_features) {
  linear_forward_ref(x, vision_param<T>(params, module + ".weight", out_features * in_features), y, rows, in_features,
                     out_features);
  bias_add_forward_ref(vision_param<T>(params, module + ".bias", out_features), y, rows, out_features);
  const VisionAdapter<T> ad = vision_adapter<T>(params, module, in_features, out_features);
  if (ad.rank == 0) return;
  std::vector<T> xa(rows * ad.rank), lora(rows * out_features), x_dropped;
  // PEFT's B(A(dropout(x))): only the adapter's input is dropped.
  const T* x_lora = dropped_input(ad.dropout, x, rows, in_features, &x_dropped);
  linear_forward_ref(x_lora, ad.a, xa.data(), rows, in_features, ad.rank);
  linear_forward_ref(xa.data(), ad.b, lora.data(), rows, ad.rank, out_features);
  for (int64_t i = 0; i < rows * out_features; ++i) y[i] += lora[i] * ad.scaling;
}

template <typename T>
void vision_project_backward(const VisionParams& params, VisionParams* grads, const std::string& module, const T* x,
                             const T* dy, T* dx, int64_t rows, int64_t in_features, int64_t out_features) {
  linear_backward_ref(x, vision_param<T>(params, module + ".weight", out_features * in_features), dy, dx,
                      optional_vision_grad<T>(grads, module + ".weight", out_features * in_features), rows,
                      in_features, out_features);
  if (T* d_bias = optional_vision_grad<T>(grads, module + ".bias", out_features)) {
    bias_add_backward_ref(dy, d_bias, rows, out_features);
  }
  const VisionAdapter<T> ad = vision_adapter<T>(params, module, in_features, out_features);
  if (ad.rank == 0) return;
  T* d_a = optional_vision_grad<T>(grads, module + ".lora_A.weight", ad.rank * in_features);
  T* d_b = optional_vision_grad<T>(grads, module + ".lora_B.weight", out_features * ad.rank);
  if (dx == nullptr && d_a == nullptr && d_b == nullptr) return;
  std::vector<T> xa(rows * ad.rank), dy_s(rows * out_features), d_xa(rows * ad.rank), x_dropped;
  const T* x_lora = dropped_input(ad.dropout, x, rows, in_features, &x_dropped);
  linear_forward_ref(x_lora, ad.a, xa.data(), rows, in_features, ad.rank);
  for (int64_t i = 0; i < rows * out_features; ++i) dy_s[i] = dy[i] * ad.scaling;
  linear_backward_ref(xa.data(), ad.b, dy_s.data(), d_xa.data(), d_b, rows, ad.rank, out_features);
  std::vector<T> dx_part(dx != nullptr ? rows * in_features : 0);
  linear_backward_ref(x_lora, ad.a, d_xa.data(), dx != nullptr ? dx_part.data() : nullptr, d_a, rows, in_features,
                      ad.rank);
  if (dx != nullptr) {
    // The adapter's input gradient goes back through the same mask and scale.
    if (ad.dropout.active()) lora_dropout_apply_ref(ad.dropout, dx_part.data(), dx_part.data(), rows, in_features);
    for (int64_t i = 0; i < rows * in_features; ++i) dx[i] += dx_part[i];
  }
}

#define DELTAMOE_INSTANTIATE(T)                                                                                  \
  template T* optional_vision_grad<T>(VisionParams*, const std::string&, int64_t);                              \
  template void vision_project_forward<T>(const VisionParams&, const std::string&, const T*, T*, int64_t, int64_t, \
                                          int64_t);                                                             \
  template void vision_project_backward<T>(const VisionParams&, VisionParams*, const std::string&, const T*,      \
                                           const T*, T*, int64_t, int64_t, int64_t);
DELTAMOE_INSTANTIATE(float)
DELTAMOE_INSTANTIATE(double)
#undef DELTAMOE_INSTANTIATE

}  // namespace deltamoe
