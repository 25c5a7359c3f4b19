// The communication of one rank of an expert-parallel + ZeRO-2 step, as bytes and modelled time
// (design §2.3, §4.4): `deltamoe bench --simulate_expert_parallel N` measures one rank's compute with
// the exchange replaced by same-size device copies, and prints beside it the N-GPU step this model
// predicts: t_step = t_compute x f_imb + t_exchange + t_reduce_scatter + t_all_gather, with nothing
// overlapped (the engine's schedule today).
#pragma once

#include <cstdint>
#include <string>

namespace deltamoe {

struct ExchangeModelInput {
  int ranks = 8;                 // the expert-parallel group = the world (EP = DP)
  int64_t tokens_per_rank = 8192;  // tokens of one micro-batch on each rank
  int64_t top_k = 8;
  int64_t hidden = 2048;
  int64_t layers = 40;           // MoE layers
  // Row exchanges per MoE layer and micro-batch: forward dispatch of x and combine of y; backward
  // dispatch of x again (the engine does not keep received rows), dispatch of dy, combine of dx.
  int exchanges_per_layer = 5;
  int64_t micro_batches = 1;     // per optimizer step
  double dense_trained_elements = 0;  // ZeRO-2: f32 gradients reduce-scattered, bf16 weights all-gathered, once per step
  double link_bytes_per_s = 350e9;    // B_eff: effective per-GPU bandwidth of the all-to-all and the RS/AG
  double imbalance = 1.0;        // f_imb: max / mean received rows over ranks
};

struct ExchangeModel {
  double exchange_bytes = 0;        // per micro-batch, rows leaving this rank (bf16)
  double reduce_scatter_bytes = 0;  // per step
  double all_gather_bytes = 0;      // per step
  double exchange_seconds = 0;      // per micro-batch
  double reduce_scatter_seconds = 0, all_gather_seconds = 0;  // per step
  double imbalance = 1.0;           // the busiest rank computes and receives this much more
  // The N-GPU optimizer step from one rank's measured compute time of the whole step.
  double predicted_step_seconds(double compute_seconds, int64_t micro_batches) const;
  std::string describe() const;
};

ExchangeModel model_exchange(const ExchangeModelInput& input);

}  // namespace deltamoe
