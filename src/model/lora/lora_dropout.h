// LoRA dropout in the CPU model (PEFT's lora.Linear: B(A(dropout(x))) * s, training passes only).
// Dropout belongs to a training pass, not to the weights: the engine opens a LoraDropoutScope
// around one micro-batch's forward and backward (with the run's p and seed, the optimizer's step
// count and the micro-batch's index), and the projection funnels ask lora_dropout_for for the mask
// of the adapter they apply. Outside a scope (evaluation, export, parity, tests of the plain
// adapter path) nothing is dropped. The scope is per thread: each rank of the CPU engine's threads
// opens its own. The adapter's index is the entry M.lora_index next to M.lora_A.weight, written by
// attach_lora_adapters when p > 0. The mask itself: kernels/lora/lora_dropout_mask.h.
#pragma once

#include <cstdint>

#include "kernels/lora/lora_dropout_mask.h"

namespace deltamoe {

class LoraDropoutScope {
 public:
  // p in [0, 1); p = 0 opens a scope that drops nothing.
  LoraDropoutScope(double p, uint64_t seed, uint64_t step, uint64_t micro_batch);
  ~LoraDropoutScope();
  LoraDropoutScope(const LoraDropoutScope&) = delete;
  LoraDropoutScope& operator=(const LoraDropoutScope&) = delete;

 private:
  const LoraDropoutScope* outer_;
  double p_;
  uint64_t seed_, step_, micro_batch_;
  friend LoraDropoutMask lora_dropout_for(int64_t adapter_index);
};

// The mask of adapter adapter_index in the open scope of this thread; inactive (drops nothing) when
// no scope is open, its p is 0, or adapter_index is negative (a module without an index entry).
LoraDropoutMask lora_dropout_for(int64_t adapter_index);

}  // namespace deltamoe
