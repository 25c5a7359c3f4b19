// Builds the per-step token layout of the text model: sequence boundaries, positions, rope tables.
#include "model/text/text_batch.h"

#include "core/error.h"
#include "kernels/attention/attention.h"
#include "model/text/text_params.h"

namespace deltamoe {

std::vector<int32_t> row_cu_seqlens(int64_t rows, int64_t seq_len) {
  std::vector<int32_t> cu_seqlens(static_cast<size_t>(rows + 1));
  for (int64_t b = 0; b <= rows; ++b) cu_seqlens[b] = static_cast<int32_t>(b * seq_len);
  return cu_seqlens;
}

std::vector<int64_t> text_positions(const std::vector<int32_t>& cu_seqlens) {
  const int64_t num_tokens = cu_seqlens.back();
  std::vector<int64_t> positions(static_cast<size_t>(3 * num_tokens));
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s)
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t)
      for (int axis = 0; axis < 3; ++axis) positions[axis * num_tokens + t] = t - cu_seqlens[s];
  return positions;
}

TextBatch make_text_batch(const TextConfig& config, int64_t num_tokens, std::vector<int32_t> cu_seqlens,
                          std::vector<int64_t> positions) {
  CHECK(cu_seqlens.size() >= 2, "text batch: cu_seqlens needs at least two entries, got ", cu_seqlens.size());
  check_cu_seqlens(cu_seqlens.data(), static_cast<int64_t>(cu_seqlens.size()) - 1, num_tokens, "text batch");
  if (positions.empty()) positions = text_positions(cu_seqlens);
  CHECK(static_cast<int64_t>(positions.size()) == 3 * num_tokens, "text batch: positions must be [3, ", num_tokens,
        "], got ", positions.size(), " values");
  CHECK(config.mrope_section.size() == 3, "text config: mrope_section must have 3 entries, got ",
        config.mrope_section.size());
  TextBatch batch;
  batch.num_tokens = num_tokens;
  batch.cu_seqlens = std::move(cu_seqlens);
  batch.positions = std::move(positions);
  batch.rope.rotary_dim = text_rotary_dim(config);
  batch.rope.section = {config.mrope_section[0], config.mrope_section[1], config.mrope_section[2]};
  batch.rope.theta = config.rope_theta;
  const int64_t half = batch.rope.rotary_dim / 2;
  batch.rope_cos.resize(static_cast<size_t>(num_tokens * half));
  batch.rope_sin.resize(static_cast<size_t>(num_tokens * half));
  mrope_tables_ref(batch.rope, batch.positions.data(), num_tokens, batch.rope_cos.data(), batch.rope_sin.data());
  return batch;
}

}  // namespace deltamoe
