// The per-thread LoRA dropout scope of the CPU model (see lora_dropout.h).
#include "model/lora/lora_dropout.h"

#include "core/error.h"

namespace deltamoe {

namespace {
thread_local const LoraDropoutScope* g_scope = nullptr;
}  // namespace

LoraDropoutScope::LoraDropoutScope(double p, uint64_t seed, uint64_t step, uint64_t micro_batch)
    : outer_(g_scope), p_(p), seed_(seed), step_(step), micro_batch_(micro_batch) {
  CHECK(p >= 0 && p < 1, "--lora_dropout must be in [0, 1), got ", p);
  g_scope = this;
}

LoraDropoutScope::~LoraDropoutScope() { g_scope = outer_; }

LoraDropoutMask lora_dropout_for(int64_t adapter_index) {
  const LoraDropoutScope* scope = g_scope;
  if (scope == nullptr) return LoraDropoutMask{};
  return lora_dropout_mask(LoraDropoutKey{scope->p_, scope->seed_, scope->step_, scope->micro_batch_}, adapter_index);
}

}  // namespace deltamoe
