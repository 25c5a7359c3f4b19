// What the GPU engine reruns in the backward instead of keeping it from the forward (activation
// recompute; flags in cli/recompute_flags.h, docs/training.md "Recompute").
#pragma once

#include <cstdint>

namespace deltamoe {

// Activation recompute: granularity selective keeps one set of mixer internals per layer type and
// reruns each mixer's forward before its backward (~1/3 more mixer time); full keeps only the fp32
// input of the first `layers` decoder layers and reruns those layers whole; the vision tower's
// blocks likewise (`vision_blocks`; full recompute takes every one when the tower trains).
inline constexpr int64_t kRecomputeAllLayers = -1;
struct RecomputeOptions {
  bool mixers = false;     // selective
  int64_t layers = 0;      // full: the first `layers` decoder layers (kRecomputeAllLayers: every one)
  // The first `vision_blocks` ViT blocks (kRecomputeAllLayers: every one) keep only their fp32
  // input; nothing when the ViT is frozen (it then keeps nothing for a backward anyway).
  int64_t vision_blocks = 0;
  // The engine picks `vision_blocks` and then `layers` when it plans its memory: none when
  // everything fits, else the fewest ViT blocks, then (all of those and) the fewest decoder layers
  // with which the plan fits (a run that does not fit even then is refused as before).
  bool automatic = false;
  // The routed experts' permuted inputs and gate/up rows of every layer not fully recomputed are
  // kept from the forward ([T K, C + 2 I] bf16 a layer), so that the experts' backward skips forming
  // them again (a permute and a grouped GEMM). The
  // GPU engine sets it when the plan has room for them as it stands (after --recompute's own
  // choice it never recomputes more to make room); never with expert parallelism.
  bool keep_expert_rows = false;
  // Each GDN set keeps the gated delta rule forward's chunk quantities and states for its backward
  // (the forward workspace layout: 320 MiB a set at 8,192 tokens and the 35B widths), which then
  // skips recomputing them; a set is a layer's own, or the one its rerun mixers share. Chosen by
  // the GPU engine like keep_expert_rows; under expert parallelism only when the plan also holds
  // the expert exchange at its worst case (docs/training.md, "Recompute").
  bool keep_gdn_forward = false;
  // Decoder layers recomputed whole in a model of num_layers.
  int64_t full_layers(int64_t num_layers) const {
    return layers == kRecomputeAllLayers ? num_layers : layers;
  }
  // ViT blocks recomputed whole in a tower of `depth` blocks.
  int64_t full_vision_blocks(int64_t depth) const {
    return vision_blocks == kRecomputeAllLayers ? depth : vision_blocks;
  }
};

}  // namespace deltamoe
