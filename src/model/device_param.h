// DeviceParam: one parameter as a GPU model reads it, views into the device state that owns it
// (DeviceParams), bound once at setup so that no step looks a name up. Plain pointers, so the
// binding code (which tensors exist, which are read in fp32) also builds without CUDA.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/device_bf16.h"
#include "core/dtype.h"

namespace deltamoe {

// A LoRA adapter on a projection weight (model/lora/lora.h): views of its A [r, in] and B [out, r]
// (trained tensors of the same owner) and the scaling. rank 0: none.
struct DeviceLoraViews {
  const DeviceBf16* a = nullptr;
  const DeviceBf16* b = nullptr;
  float* grad_a = nullptr;  // null with grad_b: a frozen adapter
  float* grad_b = nullptr;
  int64_t rank = 0;
  float scaling = 0;
  int64_t index = -1;  // the target's index in LoraAdapters::targets: keys its dropout mask (-1: none)
  bool attached() const { return rank > 0; }
};

struct DeviceParam {
  const DeviceBf16* w = nullptr;      // bf16 working weight (every parameter has one)
  // fp32 values, for the tensors the math reads in fp32 (norm weights, gates, the embedding and
  // position tables, the router): the master of a trained tensor, an fp32 copy of a frozen one.
  const float* f32 = nullptr;
  float* grad = nullptr;  // fp32 gradient, added to
  // bf16 gradient instead of grad (the routed experts': DeviceParamSpec::grad_bf16). Both null:
  // frozen, so its weight-gradient work is skipped.
  DeviceBf16* grad_bf16 = nullptr;
  int64_t numel = 0;
  bool trained() const { return grad != nullptr || grad_bf16 != nullptr; }
  // The gradient whichever its type (null: frozen), and that type.
  void* grad_data() const { return grad_bf16 != nullptr ? static_cast<void*>(grad_bf16) : static_cast<void*>(grad); }
  DType grad_dtype() const { return grad_bf16 != nullptr ? DType::bf16 : DType::f32; }
  DeviceLoraViews lora;  // the projection's adapter, if one is attached (bind_text_weights)
};

// The lookup a binder uses: the views of `name`; needs_f32 says the model reads its fp32 values.
using DeviceParamLookup = std::function<DeviceParam(const std::string& name, bool needs_f32)>;

// The LoRA adapter of a weight module (e.g. "model.layers.0.self_attn.q_proj"), rank 0 when it has
// none; a binder attaches it to the module's weight.
using DeviceLoraLookup = std::function<DeviceLoraViews(const std::string& module)>;

}  // namespace deltamoe
