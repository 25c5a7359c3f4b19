// Random test tensors from the project's Philox generator.
#include "kernels/common/tensor_compare.h"

#include "core/rng.h"

namespace deltamoe {

HostTensor random_normal_tensor(Shape shape, uint64_t seed, float scale) {
  HostTensor out(DType::f32, shape);
  Rng rng(seed);
  float* values = out.as<float>();
  for (int64_t i = 0; i < out.numel(); ++i) values[i] = static_cast<float>(rng.normal()) * scale;
  return out;
}

}  // namespace deltamoe
