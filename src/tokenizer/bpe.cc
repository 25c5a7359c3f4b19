// Byte-pair merging: a direct scan for short pieces, a priority queue over a linked list of
// symbols for long ones (long runs of spaces or letters would be quadratic otherwise).
#include "tokenizer/bpe.h"

#include <algorithm>
#include <bit>
#include <queue>

namespace deltamoe {

void BpeMerges::add(int32_t left, int32_t right, int32_t merged, int32_t rank) {
  pending_.push_back({pack(left, right), rank, merged});
}

void BpeMerges::finish() {
  const size_t capacity = std::bit_ceil(std::max<size_t>(16, pending_.size() * 2));
  slots_.assign(capacity, Slot{});
  mask_ = capacity - 1;
  for (const Slot& entry : pending_) {
    for (size_t slot = hash(entry.key) & mask_;; slot = (slot + 1) & mask_) {
      if (slots_[slot].key == entry.key || slots_[slot].key == kEmpty) {
        slots_[slot] = entry;
        break;
      }
    }
  }
  pending_.clear();
  pending_.shrink_to_fit();
}

namespace {

constexpr size_t kDirectScanMaxSymbols = 48;

// Repeatedly merges the lowest-ranked adjacent pair, leftmost first. The pair merges are looked up
// once and then only around each merge.
void merge_direct(std::vector<int32_t>& symbols, const BpeMerges& merges) {
  thread_local std::vector<BpeMerges::Merge> pairs;  // pairs[i]: merge of symbols[i], symbols[i + 1]
  pairs.clear();
  for (size_t i = 0; i + 1 < symbols.size(); ++i) pairs.push_back(merges.find(symbols[i], symbols[i + 1]));
  while (!pairs.empty()) {
    size_t best = pairs.size();
    for (size_t i = 0; i < pairs.size(); ++i) {
      if (pairs[i].rank >= 0 && (best == pairs.size() || pairs[i].rank < pairs[best].rank)) best = i;
    }
    if (best == pairs.size()) return;
    symbols[best] = pairs[best].merged;
    symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(best) + 1);
    pairs.erase(pairs.begin() + static_cast<std::ptrdiff_t>(best));
    if (best > 0) pairs[best - 1] = merges.find(symbols[best - 1], symbols[best]);
    if (best < pairs.size()) pairs[best] = merges.find(symbols[best], symbols[best + 1]);
  }
}

// Same order of merges as merge_direct, in O(n log n): candidates sit in a min-heap keyed by
// (rank, position); a candidate is stale once either symbol changed.
void merge_with_queue(std::vector<int32_t>& symbols, const BpeMerges& merges) {
  const int n = static_cast<int>(symbols.size());
  std::vector<int> prev(n), next(n);
  for (int i = 0; i < n; ++i) prev[i] = i - 1, next[i] = i + 1 < n ? i + 1 : -1;
  struct Candidate {
    int32_t rank;
    int position;
    int32_t left, right, merged;
    bool operator>(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : position > other.position;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  const auto push = [&](int position) {
    if (position < 0 || next[position] < 0) return;
    const int32_t left = symbols[position], right = symbols[next[position]];
    const BpeMerges::Merge merge = merges.find(left, right);
    if (merge.rank >= 0) queue.push({merge.rank, position, left, right, merge.merged});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    const int right_position = next[top.position];
    if (symbols[top.position] != top.left || right_position < 0 || symbols[right_position] != top.right) continue;
    symbols[top.position] = top.merged;
    symbols[right_position] = -1;
    next[top.position] = next[right_position];
    if (next[right_position] >= 0) prev[next[right_position]] = top.position;
    push(prev[top.position]);
    push(top.position);
  }
  symbols.erase(std::remove(symbols.begin(), symbols.end(), -1), symbols.end());
}

}  // namespace

void bpe_merge_piece(std::string_view piece, const std::array<int32_t, 256>& byte_ids, const BpeMerges& merges,
                     std::vector<int32_t>& out) {
  if (piece.size() == 1) {
    out.push_back(byte_ids[static_cast<unsigned char>(piece[0])]);
    return;
  }
  thread_local std::vector<int32_t> symbols;
  symbols.clear();
  for (char byte : piece) symbols.push_back(byte_ids[static_cast<unsigned char>(byte)]);
  if (symbols.size() <= kDirectScanMaxSymbols) {
    merge_direct(symbols, merges);
  } else {
    merge_with_queue(symbols, merges);
  }
  out.insert(out.end(), symbols.begin(), symbols.end());
}

}  // namespace deltamoe

