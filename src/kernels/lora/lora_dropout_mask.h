// LoRA dropout's mask (PEFT's lora.Linear: y = base(x) + B(A(dropout(x))) * s while training), as a
// pure function of counters so that the CPU reference and the GPU kernels drop the same elements, a
// recomputed layer sees the mask of its first forward, and --resume needs no RNG state.
//
// Element (row, col) of the adapter's input x [rows, in] of adapter `adapter` in micro-batch
// `micro_batch` of the step whose optimizer has applied `step` updates is kept iff
//   philox4x32({col / 4, row, adapter, micro_batch}, key(seed, step))[col % 4] >= threshold
// with key = the first two words of philox4x32({step, step >> 32, 'LoRA', 'Drop'}, seed) and
// threshold = round(p 2^32) (so the dropped fraction is p to 2^-32); a kept element is multiplied
// by keep_scale = 1 / (1 - p) (inverted dropout, as torch's nn.Dropout). Philox4x32-10 is
// core/rng.h's (lora_dropout_mask_test checks the two agree).
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define DELTAMOE_LORA_HD __host__ __device__ __forceinline__
#else
#define DELTAMOE_LORA_HD inline
#endif

namespace deltamoe {

// What one adapter's mask in one micro-batch depends on (plain values: passed to kernels by value).
struct LoraDropoutMask {
  uint32_t key0 = 0, key1 = 0;  // from (seed, step): lora_dropout_mask()
  uint32_t adapter = 0;         // the target's index in LoraAdapters::targets
  uint32_t micro_batch = 0;     // the micro-batch's index in the step (over all ranks)
  uint32_t threshold = 0;       // round(p 2^32): 0 drops nothing
  float keep_scale = 1.0f;      // 1 / (1 - p)
  bool active() const { return threshold != 0; }
};

struct LoraPhilox4 {
  uint32_t v[4];
};

DELTAMOE_LORA_HD LoraPhilox4 lora_philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                             uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t product0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint64_t product1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t n0 = static_cast<uint32_t>(product1 >> 32) ^ c1 ^ k0;
    const uint32_t n1 = static_cast<uint32_t>(product1);
    const uint32_t n2 = static_cast<uint32_t>(product0 >> 32) ^ c3 ^ k1;
    const uint32_t n3 = static_cast<uint32_t>(product0);
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return LoraPhilox4{{c0, c1, c2, c3}};
}

// The four mask words of columns 4 q .. 4 q + 3 of one row (one Philox block).
DELTAMOE_LORA_HD LoraPhilox4 lora_dropout_block(const LoraDropoutMask& m, int64_t row, int64_t quad) {
  return lora_philox4x32(static_cast<uint32_t>(quad), static_cast<uint32_t>(row), m.adapter, m.micro_batch, m.key0,
                         m.key1);
}

// The multiplier of x[row, col]: 0 (dropped) or keep_scale.
DELTAMOE_LORA_HD float lora_dropout_factor(const LoraDropoutMask& m, int64_t row, int64_t col) {
  const LoraPhilox4 block = lora_dropout_block(m, row, col >> 2);
  return block.v[col & 3] >= m.threshold ? m.keep_scale : 0.0f;
}

// The mask of adapter `adapter` (p in [0, 1)) in micro-batch `micro_batch` of the step after `step`
// optimizer updates of a run seeded `seed`. p = 0 gives an inactive mask.
LoraDropoutMask lora_dropout_mask(double p, uint64_t seed, uint64_t step, uint64_t micro_batch, uint64_t adapter);

// One training pass's counters: the run's p and seed, the optimizer updates applied so far, the
// micro-batch's index in the step. p = 0: no dropout.
struct LoraDropoutKey {
  double p = 0;
  uint64_t seed = 0, step = 0, micro_batch = 0;
};

// The mask of adapter adapter_index in that pass; inactive when p = 0 or adapter_index < 0.
LoraDropoutMask lora_dropout_mask(const LoraDropoutKey& key, int64_t adapter_index);

// Scratch a dropping dense adapter of the GPU needs (kernels/lora/lora_cuda.h): rows * in fp32
// (x' in bf16, then the adapter's input gradient in fp32 before its mask).
size_t lora_dropout_scratch_bytes(int64_t rows, int64_t in_features);

// CPU reference: out [rows, cols] = dropout(x) (x's rows are rows row_offset .. of the mask), written;
// out may be x. Also the backward: d(dropout(x))/dx is the same elementwise factor.
template <typename T>
void lora_dropout_apply_ref(const LoraDropoutMask& mask, const T* x, T* out, int64_t rows, int64_t cols,
                            int64_t row_offset = 0);

}  // namespace deltamoe
