// Validation of cu_seqlens, the packed-sequence description shared by the Gated DeltaNet ops.
// cu_seqlens has N+1 int32 entries: 0 = c[0] <= c[1] <= ... <= c[N] = T; sequence n is [c[n],
// c[n+1]).
#pragma once

#include <cstdint>

#include "core/error.h"

namespace deltamoe::gdn_ref {

// Throws deltamoe::Error naming `op_name` when cu_seqlens does not describe num_tokens tokens
// split into num_seqs sequences (empty sequences are allowed).
inline void check_cu_seqlens(const char* op_name, const int32_t* cu_seqlens, int num_seqs,
                             int64_t num_tokens) {
  CHECK(cu_seqlens != nullptr, op_name, ": cu_seqlens is null");
  CHECK(num_seqs >= 1, op_name, ": need at least one sequence, got num_seqs=", num_seqs);
  CHECK(cu_seqlens[0] == 0, op_name, ": cu_seqlens[0] must be 0, got ", cu_seqlens[0]);
  for (int n = 0; n < num_seqs; ++n) {
    CHECK(cu_seqlens[n + 1] >= cu_seqlens[n], op_name,
          ": cu_seqlens must not decrease, but cu_seqlens[", n + 1, "]=", cu_seqlens[n + 1],
          " < cu_seqlens[", n, "]=", cu_seqlens[n]);
  }
  CHECK(cu_seqlens[num_seqs] == num_tokens, op_name, ": cu_seqlens[", num_seqs,
        "]=", cu_seqlens[num_seqs], " must equal the token count T=", num_tokens);
}

}  // namespace deltamoe::gdn_ref
