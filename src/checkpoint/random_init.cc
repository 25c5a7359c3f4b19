// Random initialisation following transformers' _init_weights for Qwen3.5-MoE, produced lazily for
// any element range (one Philox stream per tensor, value i at a fixed counter), so results depend
// neither on threads nor on how the writer splits a tensor.
#include "checkpoint/random_init.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/parallel_ranges.h"
#include "core/rng.h"
#include "model/param_table.h"

namespace deltamoe {
namespace {

// Each value takes one Philox block (4 x u32: normal() uses all four), so value i of a tensor is
// drawn at stream position 4 * i and any element range can be produced on its own.
constexpr uint64_t kDrawsPerValue = 4;
// Ranges smaller than this are produced on the calling thread.
constexpr int64_t kMinElementsPerThread = int64_t{1} << 16;

uint64_t fnv1a(const std::string& text) {
  uint64_t hash = 1469598103934665603ull;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return hash;
}

void store(void* dst, DType dtype, int64_t index, double value) {
  float f = static_cast<float>(value);
  switch (dtype) {
    case DType::f32: static_cast<float*>(dst)[index] = f; break;
    case DType::bf16: static_cast<uint16_t*>(dst)[index] = float_to_bf16_bits(f); break;
    case DType::f16: static_cast<uint16_t*>(dst)[index] = float_to_f16_bits(f); break;
    default: RAISE("random init: unsupported dtype ", dtype_name(dtype));
  }
}

// Writes values [begin, end) of one tensor to out[0 .. end - begin).
void fill_range(void* out, DType dtype, InitKind init, double std_dev, uint64_t seed, uint64_t stream, int64_t begin,
                int64_t end) {
  Rng rng(seed, stream);
  for (int64_t i = begin; i < end; ++i) {
    rng.seek(static_cast<uint64_t>(i) * kDrawsPerValue);
    double value = 0.0;
    switch (init) {
      case InitKind::normal: value = rng.normal() * std_dev; break;
      case InitKind::zeros: value = 0.0; break;
      case InitKind::ones: value = 1.0; break;
      // transformers draws A from U(0, 16); the lower bound 0.01 keeps log(A) finite.
      case InitKind::a_log: value = std::log(0.01 + (16.0 - 0.01) * rng.uniform_f64()); break;
    }
    store(out, dtype, i - begin, value);
  }
}

StoredTensor make_random_tensor(const ParamSpec& spec, double std_dev, uint64_t seed) {
  const uint64_t stream = fnv1a(spec.name);
  const DType dtype = spec.dtype;
  const InitKind init = spec.init;
  const int64_t numel = spec.shape.numel();
  const size_t element = dtype_size(dtype);
  const std::string name = spec.name;
  return StoredTensor::from_range_producer(dtype, spec.shape, [=](void* dst, size_t byte_offset, size_t nbytes) {
    CHECK(byte_offset % element == 0 && nbytes % element == 0, "random init: byte range not element aligned");
    const int64_t first = static_cast<int64_t>(byte_offset / element);
    const int64_t count = static_cast<int64_t>(nbytes / element);
    CHECK(first + count <= numel, "random init: range past the end of ", name);
    parallel_ranges(count, kMinElementsPerThread, [&](int64_t begin, int64_t end) {
      fill_range(static_cast<uint8_t*>(dst) + begin * element, dtype, init, std_dev, seed, stream, first + begin,
                 first + end);
    });
  });
}

}  // namespace

ModelCheckpoint random_init_checkpoint(const ModelConfig& config, uint64_t seed, DType dtype) {
  CHECK(dtype == DType::bf16 || dtype == DType::f32, "init: --dtype must be bf16 or f32, got ", dtype_name(dtype));
  ModelCheckpoint checkpoint;
  checkpoint.config = config;
  checkpoint.config.original_json.clear();
  checkpoint.config.text.dtype = dtype == DType::bf16 ? "bfloat16" : "float32";
  checkpoint.expert_layout = ExpertLayout::fused;
  for (const ParamSpec& spec : build_param_table(config, dtype)) {
    double std_dev =
        spec.component == Component::vision ? config.vision.initializer_range : config.text.initializer_range;
    checkpoint.params[spec.name] = make_random_tensor(spec, std_dev, seed);
  }
  return checkpoint;
}

}  // namespace deltamoe
