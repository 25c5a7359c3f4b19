// Random test tensors from the project's Philox generator.
#include "kernels/common/tensor_compare.h"

#include "core/parallel_ranges.h"
#include "core/rng.h"

namespace deltamoe {

HostTensor random_normal_tensor(Shape shape, uint64_t seed, float scale) {
  HostTensor out(DType::f32, shape);
  float* values = out.as<float>();
  // Value i is drawn at stream position 4 i (normal() takes one Philox block), so ranges can be
  // drawn on their own threads with the values of one sequential walk (the 35B-width GPU tests draw
  // gigabyte tensors).
  parallel_ranges(out.numel(), int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    Rng rng(seed);
    rng.seek(static_cast<uint64_t>(begin) * 4);
    for (int64_t i = begin; i < end; ++i) values[i] = static_cast<float>(rng.normal()) * scale;
  });
  return out;
}

}  // namespace deltamoe
