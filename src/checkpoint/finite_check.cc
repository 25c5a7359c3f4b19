// Exponent-all-ones tests per dtype; the OR-reduction over a piece has no branch and vectorises.
#include "checkpoint/finite_check.h"

#include <cstring>

namespace deltamoe {
namespace {

// True when some element's exponent bits are all ones (NaN or Inf). The bytes may be unaligned.
template <typename Bits>
bool has_non_finite(const uint8_t* data, size_t count, Bits exponent) {
  uint32_t found = 0;
  for (size_t i = 0; i < count; ++i) {
    Bits x;
    std::memcpy(&x, data + i * sizeof(Bits), sizeof(Bits));
    found |= static_cast<uint32_t>((x & exponent) == exponent);
  }
  return found != 0;
}

template <typename Bits>
int64_t first_in(const uint8_t* data, size_t count, Bits exponent) {
  for (size_t i = 0; i < count; ++i) {
    Bits x;
    std::memcpy(&x, data + i * sizeof(Bits), sizeof(Bits));
    if ((x & exponent) == exponent) return static_cast<int64_t>(i);
  }
  return -1;
}

template <typename Bits>
int64_t scan(const StoredTensor& tensor, Bits exponent) {
  int64_t first = -1;
  size_t elements_before = 0;
  tensor.for_each_piece([&](const uint8_t* piece, size_t nbytes) {
    const size_t count = nbytes / sizeof(Bits);
    if (first < 0 && has_non_finite(piece, count, exponent)) {
      first = static_cast<int64_t>(elements_before) + first_in(piece, count, exponent);
    }
    elements_before += count;
  });
  return first;
}

}  // namespace

int64_t first_non_finite_element(const StoredTensor& tensor) {
  switch (tensor.dtype()) {
    case DType::f32: return scan<uint32_t>(tensor, 0x7F800000u);
    case DType::bf16: return scan<uint16_t>(tensor, 0x7F80u);
    case DType::f16: return scan<uint16_t>(tensor, 0x7C00u);
    case DType::f64: return scan<uint64_t>(tensor, 0x7FF0000000000000ull);
    default: return -1;
  }
}

}  // namespace deltamoe
