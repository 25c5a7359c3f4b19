// LoRA dropout's mask key and its CPU application (see lora_dropout_mask.h).
#include <cmath>

#include "core/error.h"
#include "kernels/lora/lora_dropout_mask.h"

namespace deltamoe {

LoraDropoutMask lora_dropout_mask(double p, uint64_t seed, uint64_t step, uint64_t micro_batch, uint64_t adapter) {
  CHECK(p >= 0 && p < 1, "LoRA dropout: p must be in [0, 1), got ", p);
  CHECK(micro_batch <= UINT32_MAX && adapter <= UINT32_MAX, "LoRA dropout: micro-batch ", micro_batch,
        " or adapter ", adapter, " does not fit the mask's 32-bit counters");
  LoraDropoutMask mask;
  const LoraPhilox4 key = lora_philox4x32(static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32),
                                          0x4C6F5241u /* 'LoRA' */, 0x44726F70u /* 'Drop' */,
                                          static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  mask.key0 = key.v[0];
  mask.key1 = key.v[1];
  mask.adapter = static_cast<uint32_t>(adapter);
  mask.micro_batch = static_cast<uint32_t>(micro_batch);
  const double threshold = std::nearbyint(p * 4294967296.0);
  mask.threshold = threshold >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(threshold);
  mask.keep_scale = static_cast<float>(1.0 / (1.0 - p));
  if (!mask.active()) mask.keep_scale = 1.0f;
  return mask;
}

LoraDropoutMask lora_dropout_mask(const LoraDropoutKey& key, int64_t adapter_index) {
  if (key.p == 0 || adapter_index < 0) return LoraDropoutMask{};
  return lora_dropout_mask(key.p, key.seed, key.step, key.micro_batch, static_cast<uint64_t>(adapter_index));
}

size_t lora_dropout_scratch_bytes(int64_t rows, int64_t in_features) {
  return sizeof(float) * static_cast<size_t>(rows) * static_cast<size_t>(in_features);
}

template <typename T>
void lora_dropout_apply_ref(const LoraDropoutMask& mask, const T* x, T* out, int64_t rows, int64_t cols,
                            int64_t row_offset) {
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t i = 0; i < cols; ++i) {
      const float factor = lora_dropout_factor(mask, row_offset + t, i);
      out[t * cols + i] = x[t * cols + i] * static_cast<T>(factor);
    }
  }
}

template void lora_dropout_apply_ref<float>(const LoraDropoutMask&, const float*, float*, int64_t, int64_t, int64_t);
template void lora_dropout_apply_ref<double>(const LoraDropoutMask&, const double*, double*, int64_t, int64_t,
                                             int64_t);

}  // namespace deltamoe
