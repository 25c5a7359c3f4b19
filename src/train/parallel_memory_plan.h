// Per-GPU memory of one rank of a parallel run: the single-GPU planner's terms
// (memory_plan.h) with the training state split by the layout (routed experts 1/EP per rank with
// their master, gradient and moments; other tensors' bf16 weights replicated and, under ZeRO-2,
// their fp32 gradient, master and moments 1/DP per rank), the activations under a recompute choice,
// and the expert-parallel exchange buffers. `deltamoe plan` prints it.
#pragma once

#include <cstddef>
#include <string>

#include "train/memory_plan.h"
#include "train/parallel_layout.h"

namespace deltamoe {

enum class RecomputeChoice {
  none,    // every layer keeps its activations
  selective,  // one set of mixer internals per layer type, rerun before each mixer's backward
  full,       // each layer keeps only its fp32 input and is rerun whole in the backward (one shared set)
};
// "none", "selective", "full"; false for anything else.
bool parse_recompute_choice(const std::string& text, RecomputeChoice* out);
const char* recompute_choice_name(RecomputeChoice choice);

struct ParallelPlanOptions {
  int world = 1;                        // ranks (GPUs) = the data-parallel size of the dense tensors
  ParallelOptions layout;               // EP and ZeRO-2
  RecomputeChoice recompute = RecomputeChoice::none;
  bool images = true;                   // plan the vision tower's activations (false: text-only batches)
  // With --expert_recv_headroom auto (layout.expert_recv_headroom 0): the GPU's usable bytes, into
  // which the receive capacity grows past its minimum as the engine grows it (0: the minimum).
  size_t gpu_memory_bytes = 0;
};

struct ParallelMemoryPlan {
  MemoryPlan plan;                  // per rank; plan.total() excludes the exchange below
  // The expert exchange (EP > 1): its receive capacity in rows per micro-batch and layer, and its
  // buffers (expert_exchange_bytes; the engine keeps no received rows for the backward, which
  // dispatches the layer input again).
  int64_t expert_recv_rows = 0;
  double expert_recv_headroom = 0;  // expert_recv_rows over the mean received rows
  size_t exchange = 0;
  size_t total() const { return plan.total() + exchange; }
  std::string describe() const;
};

// The training state of one rank as the GPU engine holds it (DeviceTrainState's sharded form):
// its own routed experts' slices (EP > 1) with their master, gradient and moments; every other
// tensor's bf16 weight in full; under ZeRO-2 the dense master, moments and reduced gradient only for
// this rank's 1/world piece (plan->sharding: the reduced pieces) and one shared region that each
// backward phase's dense gradients take in turn and the weight all-gather stages in
// (sharded_region.h, counted with the gradients); fp32 working copies of trained tensors read in
// fp32. Sets the state fields of plan.
// expert_grad_dtype: the expert slices' gradients (bf16 or f32) where expert parallelism splits them.
void plan_rank_state_bytes(const ModelConfig& config, const FreezeOptions& freeze, DType moment_dtype, int world,
                           const ParallelOptions& layout, MemoryPlan* plan, DType expert_grad_dtype = DType::bf16);

// options: the single-GPU engine options (token budget, freeze, moments, image pixels). Checks the
// layout against the model (EP divides the experts and the world) naming the flags.
ParallelMemoryPlan plan_parallel_memory(const ModelConfig& config, const EngineOptions& options,
                                        const ParallelPlanOptions& parallel);

}  // namespace deltamoe
