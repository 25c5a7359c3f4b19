// Random initialisation following transformers' _init_weights for Qwen3.5-MoE, produced lazily
// in fixed-size blocks (one Philox stream per tensor block) so results do not depend on threads.
#include "checkpoint/random_init.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "model/param_table.h"

namespace deltamoe {
namespace {

constexpr int64_t kBlockElements = int64_t{1} << 20;

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

// Writes values [begin, end) of one tensor to out[0 .. end - begin); block b of a tensor always
// uses stream hash(name) + b and starts at element b * kBlockElements.
void fill_block(void* out, DType dtype, InitKind init, double std_dev, uint64_t seed, uint64_t stream, int64_t begin,
                int64_t end) {
  Rng rng(seed, stream);
  for (int64_t i = begin; i < end; ++i) {
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
  const uint64_t name_stream = fnv1a(spec.name);
  const DType dtype = spec.dtype;
  const InitKind init = spec.init;
  const int64_t numel = spec.shape.numel();
  const size_t element = dtype_size(dtype);
  // Any element range can be produced: blocks inside it are generated in place, the (at most two)
  // blocks it cuts through are generated whole into a scratch buffer and the needed part copied.
  return StoredTensor::from_range_producer(dtype, spec.shape, [=](void* dst, size_t byte_offset, size_t nbytes) {
    CHECK(byte_offset % element == 0 && nbytes % element == 0, "random init: byte range not element aligned");
    const int64_t first = static_cast<int64_t>(byte_offset / element);
    const int64_t last = first + static_cast<int64_t>(nbytes / element);
    CHECK(last <= numel, "random init: range past the end of ", spec.name);
    const int64_t first_block = first / kBlockElements, end_block = (last + kBlockElements - 1) / kBlockElements;
    const int64_t num_blocks = end_block - first_block;
    const int64_t num_threads =
        std::max<int64_t>(1, std::min<int64_t>(num_blocks, std::thread::hardware_concurrency()));
    auto work = [&](int64_t thread_idx) {
      std::vector<uint8_t> scratch;
      for (int64_t b = first_block + thread_idx; b < end_block; b += num_threads) {
        const int64_t block_begin = b * kBlockElements, block_end = std::min(numel, block_begin + kBlockElements);
        const uint64_t stream = name_stream + static_cast<uint64_t>(b);
        uint8_t* out = static_cast<uint8_t*>(dst);
        if (block_begin >= first && block_end <= last) {
          fill_block(out + (block_begin - first) * element, dtype, init, std_dev, seed, stream, block_begin, block_end);
          continue;
        }
        scratch.resize(static_cast<size_t>(block_end - block_begin) * element);
        fill_block(scratch.data(), dtype, init, std_dev, seed, stream, block_begin, block_end);
        const int64_t copy_begin = std::max(first, block_begin), copy_end = std::min(last, block_end);
        std::memcpy(out + (copy_begin - first) * element, scratch.data() + (copy_begin - block_begin) * element,
                    static_cast<size_t>(copy_end - copy_begin) * element);
      }
    };
    std::vector<std::thread> threads;
    for (int64_t t = 1; t < num_threads; ++t) threads.emplace_back(work, t);
    work(0);
    for (std::thread& thread : threads) thread.join();
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
