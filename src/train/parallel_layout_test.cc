// ParallelLayout: every dense element is in exactly one rank's piece, for 1..8 ranks, odd tensor
// sizes and buckets smaller and larger than tensors; experts go whole-expert to their owner (one per
// replica when EP < world); bad layouts are refused naming the flag.
#include "train/parallel_layout.h"

#include <gtest/gtest.h>

#include <string>

#include <vector>

#include "core/error.h"

namespace deltamoe {
namespace {

ParamLayout sample_layout() {
  ParamLayout layout;
  layout.add("model.embed_tokens.weight", {7, 5});
  layout.add("model.layers.0.mlp.experts.gate_up_proj", {4, 6, 3});
  layout.add("model.layers.0.input_layernorm.weight", {13});
  layout.add("model.layers.0.mlp.experts.down_proj", {4, 3, 3});
  layout.add("lm_head.weight", {5, 7});
  return layout;
}

TEST(ParallelLayout, EveryElementBelongsToExactlyOneRank) {
  const ParamLayout full = sample_layout();
  for (int world = 1; world <= 8; ++world) {
    for (const int64_t bucket : {1, 4, 11, 40, 1000}) {
      for (const int ep : {1, 2, world}) {
        if ((ep > 1 && 4 % ep != 0) || world % ep != 0) continue;
        SCOPED_TRACE(str_cat("world ", world, " bucket ", bucket, " ep ", ep));
        ParallelOptions options;
        options.expert_parallel_size = ep;
        options.distributed_optimizer = true;
        options.bucket_elements = bucket;
        std::vector<std::vector<int>> owners(full.num_tensors());
        for (int i = 0; i < full.num_tensors(); ++i) owners[i].assign(full.entry(i).numel, 0);
        for (int r = 0; r < world; ++r) {
          const ParallelLayout layout(full, r, world, 4, options);
          for (const ParamEntry& piece : layout.state().entries()) {
            const int index = full.find(piece.name);
            for (int64_t e = piece.tensor_begin; e < piece.tensor_begin + piece.numel; ++e) ++owners[index][e];
          }
          if (ep > 1) {
            EXPECT_EQ(layout.expert_pieces().size(), 2u);
          }
          // The rank's bucket pieces in state order are what reduce-scatter hands it.
          for (int b = 0; b < layout.num_buckets(); ++b) {
            int64_t in_state = 0;
            for (const auto& own : layout.own_piece_in_state(b)) in_state += own.count;
            int64_t in_segments = 0;
            for (const auto& segment : layout.piece_segments(b, r)) in_segments += segment.count;
            EXPECT_EQ(in_state, in_segments);
            EXPECT_LE(in_state, layout.piece_elements(b));
          }
        }
        // Dense elements: one rank; experts (EP > 1): one rank per replica of their block.
        for (int i = 0; i < full.num_tensors(); ++i) {
          const bool expert = ep > 1 && is_routed_expert_tensor(full.entry(i).name);
          for (int64_t e = 0; e < full.entry(i).numel; ++e)
            EXPECT_EQ(owners[i][e], expert ? world / ep : 1) << full.entry(i).name << " element " << e;
        }
      }
    }
  }
}

TEST(ParallelLayout, PackedBucketsHoldTheDenseElementsInOrder) {
  const ParamLayout full = sample_layout();
  std::vector<float> values(static_cast<size_t>(full.total_numel()), -1.0f);
  for (const ParamEntry& entry : full.entries())
    for (int64_t e = 0; e < entry.numel; ++e) values[entry.offset + e] = static_cast<float>(entry.offset + e);
  ParallelOptions options;
  options.expert_parallel_size = 2;
  options.distributed_optimizer = true;
  options.bucket_elements = 16;
  const ParallelLayout layout(full, 0, 2, 4, options);
  std::vector<float> dense;
  for (int b = 0; b < layout.num_buckets(); ++b) {
    std::vector<float> padded(static_cast<size_t>(2 * layout.piece_elements(b)));
    layout.pack_bucket(b, values.data(), padded.data());
    std::vector<bool> covered(padded.size(), false);
    for (int r = 0; r < 2; ++r) {
      for (const auto& segment : layout.piece_segments(b, r)) {
        const int64_t at = r * layout.piece_elements(b) + segment.in_piece;
        for (int64_t i = 0; i < segment.count; ++i) {
          EXPECT_EQ(padded[at + i], values[segment.full_offset + i]);
          covered[at + i] = true;
        }
        dense.insert(dense.end(), padded.begin() + at, padded.begin() + at + segment.count);
      }
    }
    for (size_t i = 0; i < padded.size(); ++i) {
      if (!covered[i]) {
        EXPECT_EQ(padded[i], 0.0f) << "alignment gap or padding at " << i;
      }
    }
  }
  std::vector<float> want;
  for (const char* name : {"model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight"}) {
    const ParamEntry& entry = full.entry(full.find(name));
    want.insert(want.end(), values.begin() + entry.offset, values.begin() + entry.offset + entry.numel);
  }
  EXPECT_EQ(dense, want);
}

// With the backward phases given, each phase's dense tensors form one group, groups in phase order,
// and a tensor's elements sit in its group's padded region exactly where the reduce-scatter of
// their bucket reads them: the property that lets a rank reduce a phase's gradients in place.
TEST(ParallelLayout, GroupsFollowTheBackwardPhasesAndLieBackToBack) {
  ParamLayout full;
  full.add("lm_head.weight", {5, 7});
  full.add("model.embed_tokens.weight", {7, 5});
  full.add("model.layers.0.input_layernorm.weight", {13});
  full.add("model.layers.0.mlp.experts.gate_up_proj", {4, 6, 3});
  full.add("model.layers.1.input_layernorm.weight", {13});
  full.add("model.layers.1.linear_attn.in_proj.weight", {10, 10});
  full.add("model.norm.weight", {13});
  full.add("other.weight", {3});
  const std::vector<GradientPhase> phases = {
      {{GradientPhaseKind::text_head, 0}, {"lm_head.", "model.norm."}},
      {{GradientPhaseKind::text_layer, 1}, {"model.layers.1."}},
      {{GradientPhaseKind::text_layer, 0}, {"model.layers.0."}},
      {{GradientPhaseKind::vision_merger, 0}, {"model.visual.merger."}},
      {{GradientPhaseKind::text_embedding, 0}, {"model.embed_tokens."}},
  };
  for (const int world : {1, 2, 3, 8}) {
    for (const int64_t bucket : {16, 50, 1000}) {
      SCOPED_TRACE(str_cat("world ", world, " bucket ", bucket));
      ParallelOptions options;
      options.distributed_optimizer = true;
      options.expert_parallel_size = world % 2 == 0 ? 2 : 1;
      options.bucket_elements = bucket;
      const ParallelLayout layout(full, 0, world, 4, options, &phases);
      ASSERT_EQ(layout.num_groups(), 5);  // four phases with tensors and the rest ("other.weight")
      EXPECT_EQ(layout.group_of_phase(0), 0);
      EXPECT_EQ(layout.group_of_phase(2), 2);
      EXPECT_EQ(layout.group_of_phase(3), -1);
      EXPECT_EQ(layout.group_of_phase(4), 3);
      EXPECT_EQ(layout.group_position(full.find("model.norm.weight")).first, 0);
      EXPECT_EQ(layout.group_position(full.find("model.layers.1.linear_attn.in_proj.weight")).first, 1);
      EXPECT_EQ(layout.group_position(full.find("other.weight")).first, 4);
      for (int g = 0; g < layout.num_groups(); ++g) {
        int64_t at = 0;
        for (int b = layout.group_first_bucket(g); b < layout.group_end_bucket(g); ++b) {
          EXPECT_EQ(layout.bucket_offset_in_group(b), at);
          for (int r = 0; r < world; ++r) {
            for (const auto& segment : layout.piece_segments(b, r)) {
              const auto [group, position] = layout.group_position(segment.full_entry);
              EXPECT_EQ(group, g);
              EXPECT_EQ(position % kFlatAlignmentElements, 0);
              EXPECT_EQ(position + segment.tensor_begin, at + r * layout.piece_elements(b) + segment.in_piece);
            }
          }
          at += world * layout.piece_elements(b);
        }
        EXPECT_EQ(layout.group_padded_elements(g), at);
      }
      EXPECT_EQ(layout.group_position(full.find("model.layers.0.mlp.experts.gate_up_proj")).first,
                options.expert_parallel_size > 1 ? -1 : 2);
    }
  }
}

// The routed-expert stacks are the fused parameters themselves: the LoRA adapters on them (whose
// names extend the stack's) and the shared expert are dense tensors.
TEST(ParallelLayout, RoutedExpertStacksAreTheFusedParametersOnly) {
  const std::string layer = "model.language_model.layers.3.mlp.";
  EXPECT_TRUE(is_routed_expert_tensor(layer + "experts.gate_up_proj"));
  EXPECT_TRUE(is_routed_expert_tensor(layer + "experts.down_proj"));
  EXPECT_FALSE(is_routed_expert_tensor(layer + "experts.gate_up_proj.lora_A.weight"));
  EXPECT_FALSE(is_routed_expert_tensor(layer + "experts.down_proj.lora_B.weight"));
  EXPECT_FALSE(is_routed_expert_tensor(layer + "shared_expert.down_proj.weight"));
  EXPECT_FALSE(is_routed_expert_tensor(layer + "gate.weight"));
}

TEST(ParallelLayout, BadLayoutsAreRefusedNamingTheFlag) {
  const ParamLayout full = sample_layout();
  ParallelOptions options;
  options.distributed_optimizer = true;
  options.expert_parallel_size = 3;
  EXPECT_THROW(ParallelLayout(full, 0, 3, 4, options), Error);  // 3 does not divide 4 experts
  options.expert_parallel_size = 2;
  EXPECT_THROW(ParallelLayout(full, 0, 3, 4, options), Error);  // EP 2 does not divide 3 ranks
  options.expert_parallel_size = 1;
  options.distributed_optimizer = false;
  try {
    ParallelLayout(full, 0, 2, 4, options);
    ADD_FAILURE() << "accepted 2 ranks without the distributed optimizer";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("--use_distributed_optimizer"), std::string::npos);
  }
}

}  // namespace
}  // namespace deltamoe
