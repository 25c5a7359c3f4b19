// Byte-pair merging for byte-level BPE: turns one pre-tokenized piece (raw bytes) into vocabulary
// ids by applying the merges in rank order, as Hugging Face's BPE model does (no dropout).
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

namespace deltamoe {

class BpeMerges {
 public:
  // Adds the merge (left, right) -> merged with the given rank (lower merges first). A pair listed
  // twice keeps its last entry, as Hugging Face's map building does.
  void add(int32_t left, int32_t right, int32_t merged, int32_t rank);
  // Builds the lookup table; call once after the last add.
  void finish();

  struct Merge {
    int32_t rank;
    int32_t merged;
  };
  // The merge of (left, right), or rank -1 when there is none.
  Merge find(int32_t left, int32_t right) const {
    if (slots_.empty()) return {-1, -1};
    const uint64_t key = pack(left, right);
    for (size_t slot = hash(key) & mask_;; slot = (slot + 1) & mask_) {
      const Slot& s = slots_[slot];
      if (s.key == key) return {s.rank, s.merged};
      if (s.key == kEmpty) return {-1, -1};
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  struct Slot {
    uint64_t key = kEmpty;
    int32_t rank = -1;
    int32_t merged = -1;
  };
  static uint64_t pack(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }
  static size_t hash(uint64_t key) { return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> 20); }

  std::vector<Slot> pending_;
  std::vector<Slot> slots_;  // open addressing, linear probing
  size_t mask_ = 0;
};

// Merges the byte ids of one piece; appends the resulting token ids to out.
// byte_ids[b] is the vocabulary id of byte b's alphabet character.
void bpe_merge_piece(std::string_view piece, const std::array<int32_t, 256>& byte_ids, const BpeMerges& merges,
                     std::vector<int32_t>& out);

}  // namespace deltamoe
