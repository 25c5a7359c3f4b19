// How the tokens of one step are laid out for the text model: T tokens split into sequences by
// cu_seqlens (the rows of a [B, S] batch, or packed sequences with B = 1), their 3-D (t, h, w)
// positions, and the M-RoPE cos/sin tables built from them once per step.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/mrope/mrope.h"
#include "model/config.h"

namespace deltamoe {

struct TextBatch {
  int64_t num_tokens = 0;           // T
  std::vector<int32_t> cu_seqlens;  // [N + 1]; attention and the GDN recurrences never cross these
  std::vector<int64_t> positions;   // [3, T] rows t, h, w
  MropeSpec rope;
  std::vector<float> rope_cos;  // [T, R / 2]
  std::vector<float> rope_sin;  // [T, R / 2]

  int num_seqs() const { return static_cast<int>(cu_seqlens.size()) - 1; }
};

// cu_seqlens [0, S, 2S, ..., B*S] for B rows of S tokens.
std::vector<int32_t> row_cu_seqlens(int64_t rows, int64_t seq_len);

// Text positions: each sequence counts 0, 1, 2, ... on all three axes.
std::vector<int64_t> text_positions(const std::vector<int32_t>& cu_seqlens);

// Validates cu_seqlens against T and `positions` ([3, T]; empty means text_positions) and builds the
// rope tables from the config's rope_theta, partial_rotary_factor and mrope_section.
TextBatch make_text_batch(const TextConfig& config, int64_t num_tokens, std::vector<int32_t> cu_seqlens,
                          std::vector<int64_t> positions = {});

}  // namespace deltamoe
