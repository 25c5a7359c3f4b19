// Lower bounds of a training step's time by component (the components `deltamoe bench` times with
// CUDA events, model/gpu/component_timer.h), printed beside the measured times: each component's
// model FLOPs at the chip's peak matmul rate, or the bytes it cannot avoid at the chip's memory
// bandwidth, whichever takes longer (docs/performance.md, "How FLOPs, MFU and floors are counted").
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "model/config.h"

namespace deltamoe {

// The H200's spec-sheet rates (dense bf16 matmul, the same on an H100 SXM; HBM3e): bench's MFU and
// floors use the matmul rate, and the memory rate where a GPU does not report its own.
constexpr double kH200PeakMatmulFlopsPerSecond = 989e12;
constexpr double kH200BytesPerSecond = 4.8e12;

// A GPU's peak memory bandwidth from its memory clock (kHz, as cudaDevAttrMemoryClockRate reports
// it) and bus width (bits): two transfers a clock (HBM and GDDR both). An H100 SXM (2,619 MHz, 5,120
// bits) gives 3.35 TB/s, an A800 80 GB (1,593 MHz, 5,120) 2.04 TB/s. 0 where either is unknown (<= 0).
double memory_bytes_per_second(int64_t memory_clock_khz, int64_t bus_width_bits);

struct ComponentFloor {
  double flops = 0;  // model FLOPs (forward + backward)
  double bytes = 0;  // bytes it cannot avoid
  // The larger of the two times at those rates, in milliseconds.
  double ms(double flops_per_second, double bytes_per_second) const;
  ComponentFloor& operator+=(const ComponentFloor& other);
};

// What each component of the text model cannot do without, over one micro-batch's forward and
// backward:
// - FLOPs: 6 x the matmul parameters a token passes through x tokens (model_flops.h), and causal
//   attention's 6 S^2 Hq D per sequence. The gated delta rule's chunk products, norms and
//   elementwise work are not counted.
// - Bytes: each matmul weight read by the forward and by the backward (bf16, 2 + 2 bytes) and, when
//   the text model trains, its gradient written once (4 bytes, fp32; 2 for the routed experts,
//   whose gradients are bf16): every routed expert's, not only the top-k's. Activations are not
//   counted.
// Each floor is lower than any kernel can reach; the ratio measured / floor says how far it is.
struct StepFloors {
  ComponentFloor gdn, attention, moe, lm_head_loss;
  StepFloors& operator+=(const StepFloors& other);
};
// lm_head_rows: the rows that pass through lm_head (the supervised ones: the loss head skips the
// others); -1: every token.
StepFloors micro_batch_floors(const TextConfig& config, const std::vector<int32_t>& cu_seqlens, bool text_trained,
                              int64_t lm_head_rows = -1);

// AdamW's floor for one step: per trained parameter the fp32 master read and written, the fp32
// gradient read, both moments read and written, the bf16 weight written (22 bytes with bf16
// moments, 30 with fp32); 4 bytes less for each of the split_params, the routed experts, whose
// master is kept split (its two halves read and written, the weight being one of them:
// optim/split_master.h) and whose gradient is bf16. No FLOPs.
ComponentFloor adamw_floor(int64_t trained_params, DType moment_dtype, int64_t split_params = 0);

}  // namespace deltamoe
