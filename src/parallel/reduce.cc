// The element-wise reductions of reduce.h, one loop per (type, op).
#include "parallel/reduce.h"

#include <cmath>
#include <cstring>

#include "core/error.h"

namespace deltamoe {
namespace {

template <typename T>
void sum_floats(T* acc, const T* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) acc[i] = acc[i] + x[i];
}

template <typename T>
void max_floats(T* acc, const T* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    if (std::isnan(acc[i])) continue;
    if (std::isnan(x[i]) || x[i] > acc[i]) acc[i] = x[i];
  }
}

// Two's-complement wrap-around without signed-overflow UB.
template <typename T, typename U>
void sum_ints(T* acc, const T* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    acc[i] = static_cast<T>(static_cast<U>(acc[i]) + static_cast<U>(x[i]));
  }
}

template <typename T>
void max_ints(T* acc, const T* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    if (x[i] > acc[i]) acc[i] = x[i];
  }
}

// 16-bit floats stored as bits, with their widening and rounding functions.
template <float (*widen)(uint16_t), uint16_t (*narrow)(float)>
void sum_half(uint16_t* acc, const uint16_t* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) acc[i] = narrow(widen(acc[i]) + widen(x[i]));
}

template <float (*widen)(uint16_t)>
void max_half(uint16_t* acc, const uint16_t* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const float a = widen(acc[i]);
    const float b = widen(x[i]);
    if (std::isnan(a)) continue;
    if (std::isnan(b) || b > a) acc[i] = x[i];
  }
}

}  // namespace

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::max: return "max";
  }
  return "?";
}

bool reduce_supported(DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::f32:
    case DType::f64:
    case DType::bf16:
    case DType::f16:
    case DType::i32:
    case DType::i64: return op == ReduceOp::sum || op == ReduceOp::max;
    case DType::u8:
    case DType::boolean: return op == ReduceOp::max;
  }
  return false;
}

void reduce_into(void* acc, const void* x, int64_t count, DType dtype, ReduceOp op) {
  CHECK(reduce_supported(dtype, op), "reduction '", reduce_op_name(op), "' is not defined for ",
        dtype_name(dtype), " elements (u8 and bool support max only)");
  if (count <= 0) return;
  const bool sum = op == ReduceOp::sum;
  switch (dtype) {
    case DType::f32:
      sum ? sum_floats(static_cast<float*>(acc), static_cast<const float*>(x), count)
          : max_floats(static_cast<float*>(acc), static_cast<const float*>(x), count);
      return;
    case DType::f64:
      sum ? sum_floats(static_cast<double*>(acc), static_cast<const double*>(x), count)
          : max_floats(static_cast<double*>(acc), static_cast<const double*>(x), count);
      return;
    case DType::bf16:
      sum ? sum_half<bf16_bits_to_float, float_to_bf16_bits>(static_cast<uint16_t*>(acc),
                                                            static_cast<const uint16_t*>(x), count)
          : max_half<bf16_bits_to_float>(static_cast<uint16_t*>(acc), static_cast<const uint16_t*>(x), count);
      return;
    case DType::f16:
      sum ? sum_half<f16_bits_to_float, float_to_f16_bits>(static_cast<uint16_t*>(acc),
                                                          static_cast<const uint16_t*>(x), count)
          : max_half<f16_bits_to_float>(static_cast<uint16_t*>(acc), static_cast<const uint16_t*>(x), count);
      return;
    case DType::i32:
      sum ? sum_ints<int32_t, uint32_t>(static_cast<int32_t*>(acc), static_cast<const int32_t*>(x), count)
          : max_ints(static_cast<int32_t*>(acc), static_cast<const int32_t*>(x), count);
      return;
    case DType::i64:
      sum ? sum_ints<int64_t, uint64_t>(static_cast<int64_t*>(acc), static_cast<const int64_t*>(x), count)
          : max_ints(static_cast<int64_t*>(acc), static_cast<const int64_t*>(x), count);
      return;
    case DType::u8:
    case DType::boolean:
      // Bools are stored as 0/1 bytes, so the byte max is their logical or.
      max_ints(static_cast<uint8_t*>(acc), static_cast<const uint8_t*>(x), count);
      return;
  }
}

}  // namespace deltamoe
