// Generated Unicode data (unicode_tables.cc, from tools/tokenizer/gen_unicode_tables.mjs) and the
// lookups on it: character-class flags, canonical combining class, canonical (de)composition.
#pragma once

#include <cstdint>

namespace deltamoe::unicode_data {

inline constexpr int kBlockBits = 7;  // stage-2 blocks of 128 code points
inline constexpr uint8_t kLetter = 1, kMark = 2, kNumber = 4, kWhiteSpace = 8;
// NFC quick check is not "Yes", or the combining class is not 0: text without any such code
// point is already in NFC.
inline constexpr uint8_t kNfcUnsafe = 16;

struct Decomposition {
  char32_t code_point, first, second;  // second is 0 for a singleton decomposition
};
struct Composition {
  char32_t first, second, composite;  // sorted by (first, second)
};

extern const uint16_t kFlagsIndex[0x110000 >> kBlockBits];
extern const uint8_t kFlagsBlocks[][1 << kBlockBits];
extern const uint16_t kCombiningClassIndex[0x110000 >> kBlockBits];
extern const uint8_t kCombiningClassBlocks[][1 << kBlockBits];
extern const Decomposition kDecompositions[];  // sorted by code point
extern const int kNumDecompositions;
extern const Composition kCompositions[];
extern const int kNumCompositions;

// cp must be < 0x110000.
inline uint8_t flags(char32_t cp) {
  return kFlagsBlocks[kFlagsIndex[cp >> kBlockBits]][cp & ((1 << kBlockBits) - 1)];
}
inline uint8_t combining_class(char32_t cp) {
  return kCombiningClassBlocks[kCombiningClassIndex[cp >> kBlockBits]][cp & ((1 << kBlockBits) - 1)];
}

}  // namespace deltamoe::unicode_data
