// Element types, their sizes and names, and exact bf16 / f16 <-> f32 conversion.
// bf16 rounding is round-to-nearest-even with NaN kept quiet, bit for bit as PyTorch does.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace deltamoe {

enum class DType : uint8_t { f32, bf16, f16, i32, i64, u8, boolean, f64 };

size_t dtype_size(DType dtype);
// Our short name ("f32", "bf16", ...).
std::string_view dtype_name(DType dtype);
// The safetensors spelling ("F32", "BF16", "F16", "I32", "I64", "U8", "BOOL", "F64").
std::string_view dtype_safetensors_name(DType dtype);
// Parses a safetensors dtype string; returns false for strings we do not support.
bool dtype_from_safetensors_name(std::string_view name, DType* out);
// Parses our short names and the common aliases (float32, bfloat16, float16, ...).
bool dtype_from_name(std::string_view name, DType* out);

inline uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}
inline float float_from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// Round-to-nearest-even; any NaN becomes the canonical quiet NaN 0x7FC0 (as torch does).
inline uint16_t float_to_bf16_bits(float value) {
  uint32_t bits = float_bits(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  uint32_t rounding_bias = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}
inline float bf16_bits_to_float(uint16_t bits) { return float_from_bits(static_cast<uint32_t>(bits) << 16); }

// The value an f32 takes after a round trip through bf16 (how the reference models bf16 storage).
inline float round_to_bf16(float value) { return bf16_bits_to_float(float_to_bf16_bits(value)); }

uint16_t float_to_f16_bits(float value);
float f16_bits_to_float(uint16_t bits);

// A 2-byte bf16 value type for host buffers.
struct bf16 {
  uint16_t bits = 0;
  bf16() = default;
  explicit bf16(float value) : bits(float_to_bf16_bits(value)) {}
  explicit operator float() const { return bf16_bits_to_float(bits); }
  static bf16 from_bits(uint16_t b) {
    bf16 out;
    out.bits = b;
    return out;
  }
};
static_assert(sizeof(bf16) == 2);

}  // namespace deltamoe
