// Names of element types and the IEEE half-precision conversion (round-to-nearest-even).
#include "core/dtype.h"

#include <cmath>

#include "core/error.h"

namespace deltamoe {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
    case DType::boolean: return 1;
    case DType::f64: return 8;
  }
  RAISE("unknown dtype ", static_cast<int>(dtype));
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::boolean: return "bool";
    case DType::f64: return "f64";
  }
  return "?";
}

std::string_view dtype_safetensors_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "F32";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u8: return "U8";
    case DType::boolean: return "BOOL";
    case DType::f64: return "F64";
  }
  return "?";
}

bool dtype_from_safetensors_name(std::string_view name, DType* out) {
  static constexpr DType kAll[] = {DType::f32, DType::bf16,    DType::f16, DType::i32,
                                   DType::i64, DType::u8, DType::boolean, DType::f64};
  for (DType dtype : kAll) {
    if (dtype_safetensors_name(dtype) == name) {
      *out = dtype;
      return true;
    }
  }
  return false;
}

bool dtype_from_name(std::string_view name, DType* out) {
  struct Alias {
    std::string_view name;
    DType dtype;
  };
  static constexpr Alias kAliases[] = {
      {"f32", DType::f32},        {"float32", DType::f32}, {"float", DType::f32},
      {"bf16", DType::bf16},      {"bfloat16", DType::bf16}, {"f16", DType::f16},
      {"float16", DType::f16},    {"half", DType::f16},    {"i32", DType::i32},
      {"int32", DType::i32},      {"i64", DType::i64},     {"int64", DType::i64},
      {"u8", DType::u8},          {"uint8", DType::u8},    {"bool", DType::boolean},
      {"f64", DType::f64},        {"float64", DType::f64},
  };
  for (const Alias& alias : kAliases) {
    if (alias.name == name) {
      *out = alias.dtype;
      return true;
    }
  }
  return false;
}

uint16_t float_to_f16_bits(float value) {
  uint32_t bits = float_bits(value);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return sign | 0x7E00u;  // NaN
  if (abs_bits >= 0x477FF000u) return sign | 0x7C00u;  // rounds to >= 65520: infinity
  if (abs_bits < 0x38800000u) {                        // below 2^-14: subnormal or zero
    // Scale into the subnormal range with an exact float add: the FPU rounds to nearest even.
    float magnitude = float_from_bits(abs_bits) + 0.5f;
    return sign | static_cast<uint16_t>(float_bits(magnitude) - float_bits(0.5f));
  }
  uint32_t mantissa_odd = (abs_bits >> 13) & 1u;
  abs_bits += 0xC8000FFFu + mantissa_odd;  // rebias exponent (-112 << 23) and round
  return sign | static_cast<uint16_t>(abs_bits >> 13);
}

float f16_bits_to_float(uint16_t bits) {
  uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  uint32_t exponent = (bits >> 10) & 0x1Fu;
  uint32_t mantissa = bits & 0x3FFu;
  if (exponent == 0) {
    float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return float_from_bits(sign | float_bits(magnitude));
  }
  if (exponent == 31) return float_from_bits(sign | 0x7F800000u | (mantissa << 13));
  return float_from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

}  // namespace deltamoe
