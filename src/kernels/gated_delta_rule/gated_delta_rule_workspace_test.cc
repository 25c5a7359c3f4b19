// The gated delta rule's workspace layout (gated_delta_rule_workspace.h): the state-slot and chunk
// bounds hold for any packing, the arrays are aligned and disjoint, and the Qwen3.5-35B workspace
// at 8,192 tokens does not grow with the number of sequences beyond the chunk table.
#include "kernels/gated_delta_rule/gated_delta_rule_workspace.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <utility>
#include <vector>

namespace deltamoe {
namespace {

// Chunks of one sequence, and the boundaries between two of them (the states that need a slot).
int64_t chunks_of(int64_t len) { return (len + kGatedDeltaRuleChunkSize - 1) / kGatedDeltaRuleChunkSize; }
int64_t boundaries_of(int64_t len) { return std::max<int64_t>(chunks_of(len) - 1, 0); }

TEST(GatedDeltaRuleWorkspace, SlotsAndChunksBoundEveryPacking) {
  std::mt19937 rng(7);
  const std::vector<int> typical = {0, 1, 2, 63, 64, 65, 127, 128, 129, 200, 1000};
  int64_t reached = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t T = 1 + static_cast<int64_t>(rng() % 9000);
    std::vector<int64_t> lengths;
    int64_t left = T;
    while (left > 0) {
      int64_t len = trial % 2 == 0 ? typical[rng() % typical.size()] : 1 + static_cast<int64_t>(rng() % 300);
      len = std::min(len, left);
      lengths.push_back(len);
      left -= len;
    }
    int64_t chunks = 0, slots = 0;
    for (int64_t len : lengths) {
      chunks += chunks_of(len);
      slots += boundaries_of(len);
    }
    const auto N = static_cast<int64_t>(lengths.size());
    EXPECT_LE(chunks, gated_delta_rule_max_chunks(T, N)) << "T=" << T << " N=" << N;
    EXPECT_LE(slots, gated_delta_rule_max_state_slots(T)) << "T=" << T << " N=" << N;
    reached += slots == gated_delta_rule_max_state_slots(T);
  }
  // The bound is tight: one sequence of 64 m + 1 tokens uses all m slots.
  EXPECT_GT(reached, 0);
  for (int64_t m : {0, 1, 2, 127}) {
    EXPECT_EQ(boundaries_of(64 * m + 1), gated_delta_rule_max_state_slots(64 * m + 1));
  }
  EXPECT_EQ(gated_delta_rule_max_state_slots(0), 0);
  EXPECT_EQ(gated_delta_rule_max_state_slots(64), 0);
  EXPECT_EQ(gated_delta_rule_max_state_slots(65), 1);
}

TEST(GatedDeltaRuleWorkspace, ArraysAreAlignedAndDisjoint) {
  for (bool backward : {false, true}) {
    for (int64_t T : {0, 1, 64, 65, 8192}) {
      const int64_t N = std::max<int64_t>(1, T / 8), Hk = 1, Hv = 3, Dk = 37, Dv = 45;
      const GatedDeltaRuleWorkspaceLayout l = gated_delta_rule_workspace_layout(T, N, Hk, Hv, Dk, Dv, backward);
      const int64_t slots = gated_delta_rule_max_state_slots(T);
      const int64_t F = 4, B = 2, C = kGatedDeltaRuleChunkSize;
      std::vector<std::pair<size_t, int64_t>> arrays = {
          {l.chunks, static_cast<int64_t>(kGatedDeltaRuleChunkInfoBytes) * gated_delta_rule_max_chunks(T, N)},
          {l.chunk_count, 4},
          {l.chunk_offsets, 4 * (N + 1)},
          {l.slot_offsets, 4 * (N + 1)},
          {l.gamma, F * T * Hv},
          {l.w, B * T * Hv * Dk},
          {l.v_new, B * T * Hv * Dv},
          {l.p, B * T * Hv * C},
          {l.a_inv, B * T * Hv * C},
          {l.h, B * slots * Hv * Dk * Dv}};
      if (backward) {
        arrays.insert(arrays.end(), {{l.dh, B * slots * Hv * Dk * Dv},
                                     {l.dv_new, B * T * Hv * Dv},
                                     {l.dw, B * T * Hv * Dk},
                                     {l.dq_acc, F * T * Hk * Dk},
                                     {l.dk_acc, F * T * Hk * Dk},
                                     {l.dgamma, F * T * Hv}});
      }
      size_t end = 0;
      for (size_t i = 0; i < arrays.size(); ++i) {
        const auto& [offset, bytes] = arrays[i];
        EXPECT_EQ(offset % 256, 0u) << "T=" << T;
        EXPECT_GE(offset, end) << "T=" << T << ": arrays overlap";
        end = offset + static_cast<size_t>(bytes);
        // The forward's arrays end where the backward's begin (a kept forward workspace is their head).
        if (i == 9) {
          EXPECT_GE(l.forward_total, end);
          EXPECT_LT(l.forward_total, end + 256);
          EXPECT_EQ(l.forward_total, gated_delta_rule_workspace_layout(T, N, Hk, Hv, Dk, Dv, false).total);
        }
      }
      EXPECT_GE(l.total, end);
      EXPECT_LT(l.total, end + 256);
    }
  }
}

// Qwen3.5-35B-A3B linear attention (Hk 16, Hv 32, Dk = Dv = 128) at 8,192 tokens: the backward
// holds 450 MiB of per-token arrays (gamma and d gamma per value head and dq, dk per key head in
// fp32; W, V_new, P and A rows, dV_new and dW in bf16) and 127 state slots of 1 MiB each (bf16) for
// H and for dH (254 MiB), the forward 193 + 127 MiB, whether the micro-batch holds 2 sequences or
// 1,024: only the chunk table grows with them.
TEST(GatedDeltaRuleWorkspace, Qwen35BAt8192TokensHardlyDependsOnSequences) {
  const int64_t T = 8192, Hk = 16, Hv = 32, D = 128;
  const size_t mib = size_t{1} << 20;
  for (int64_t N : {2, 1024}) {
    const size_t backward = gated_delta_rule_workspace_layout(T, N, Hk, Hv, D, D, true).total;
    const size_t forward = gated_delta_rule_workspace_layout(T, N, Hk, Hv, D, D, false).total;
    const size_t table = 20 * (T / 64 + N) + 2 * 4 * (N + 1) + 4 + 4 * 256;  // with alignment
    EXPECT_GE(backward, (450 + 254) * mib) << "N=" << N;
    EXPECT_LE(backward, (450 + 254) * mib + table) << "N=" << N;
    EXPECT_GE(forward, (193 + 127) * mib) << "N=" << N;
    EXPECT_LE(forward, (193 + 127) * mib + table) << "N=" << N;
  }
}

}  // namespace
}  // namespace deltamoe
