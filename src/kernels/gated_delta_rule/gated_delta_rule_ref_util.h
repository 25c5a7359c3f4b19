// Internal helpers of the gated delta rule references: argument checks and the index arithmetic
// of the packed [T, H, D] layouts (shared by the recurrent and the chunked forms).
#pragma once

#include <cstdint>

#include "core/error.h"
#include "kernels/gated_delta_rule/gated_delta_rule.h"
#include "kernels/gated_delta_rule/packed_sequences.h"

namespace deltamoe::gdn_ref {

inline void check_gated_delta_rule_args(const char* op_name, const GatedDeltaRuleShape& shape) {
  CHECK(shape.num_key_heads > 0 && shape.num_value_heads > 0, op_name,
        ": head counts must be positive, got Hk=", shape.num_key_heads,
        " Hv=", shape.num_value_heads);
  CHECK(shape.num_value_heads % shape.num_key_heads == 0, op_name,
        ": value heads Hv=", shape.num_value_heads,
        " must be a multiple of key heads Hk=", shape.num_key_heads);
  CHECK(shape.key_dim > 0 && shape.value_dim > 0, op_name,
        ": head dims must be positive, got Dk=", shape.key_dim, " Dv=", shape.value_dim);
  check_cu_seqlens(op_name, shape.cu_seqlens, shape.num_seqs, shape.num_tokens);
}

// Offsets of one (token, head) row or one (sequence, head) state in the contiguous layouts.
struct GdnLayout {
  explicit GdnLayout(const GatedDeltaRuleShape& shape) : s(shape) {}

  // The key head that value head h reads (consecutive value heads share a key head).
  int key_head_of(int h) const { return h / (s.num_value_heads / s.num_key_heads); }
  int64_t qk_row(int64_t t, int h) const {
    return (t * s.num_key_heads + key_head_of(h)) * s.key_dim;
  }
  int64_t v_row(int64_t t, int h) const { return (t * s.num_value_heads + h) * s.value_dim; }
  int64_t gate(int64_t t, int h) const { return t * s.num_value_heads + h; }
  int64_t state(int n, int h) const {
    return (static_cast<int64_t>(n) * s.num_value_heads + h) * s.key_dim * s.value_dim;
  }
  int64_t state_size() const { return static_cast<int64_t>(s.key_dim) * s.value_dim; }
  int64_t seq_begin(int n) const { return s.cu_seqlens[n]; }
  int64_t seq_end(int n) const { return s.cu_seqlens[n + 1]; }

  const GatedDeltaRuleShape& s;
};

}  // namespace deltamoe::gdn_ref
