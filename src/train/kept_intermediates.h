// What the GPU engine keeps from the forward for the backward instead of recomputing it there
// (RecomputeOptions::keep_expert_rows, keep_gdn_forward): the rule, as plain host arithmetic over
// the plan sizes the engine supplies, so that it is tested on the CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace deltamoe {

struct KeptIntermediates {
  // The routed experts' permuted inputs and gate/up rows, by every layer not fully recomputed.
  bool expert_rows = false;
  bool gdn_forward = false;  // each GDN set's gated delta rule forward workspace
};

// Memory left free beyond the plan's own reserve whenever something is kept: what the plan does
// not count (library workspaces taken lazily, fragmentation) had that slack before and keeps it.
inline constexpr size_t kKeepMarginBytes = size_t{2} << 30;

// What each saves a step, measured on the H200 at the 35B widths and 8,192 tokens: the experts'
// gate/up grouped GEMM a kept layer (its permute, ~0.1 ms more, is not counted until measured),
// the rule's chunk preparation and state scan a GDN layer.
inline constexpr double kKeptRowsMsPerLayer = 0.55;
inline constexpr double kKeptGdnMsPerLayer = 0.8;

// Both if the plan with both fits `available` with the margin, else the one that saves more by the
// figures above, else the other, else neither. rows_layers: layers that would keep rows (0: rows
// are not a candidate); gdn_layers: the model's GDN layers (0: likewise). plan_total(choice): the
// plan's total bytes with that choice.
KeptIntermediates choose_kept_intermediates(int64_t rows_layers, int64_t gdn_layers, size_t available,
                                            const std::function<size_t(const KeptIntermediates&)>& plan_total);

}  // namespace deltamoe
