// DeviceTrainState: the GPU engine's training state — the model's parameters (DeviceParams: bf16
// weights, fp32 master, fp32 gradients, fp32 copies of frozen tensors read in fp32) plus the AdamW
// moments of the trained ones — and the optimizer step on the device (global norm, clipping,
// AdamW writing the new bf16 weights). It is the engine's TrainStateStore: host copies are made
// only to save or resume.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "core/device_buffer.h"
#include "model/gpu/device_params.h"
#include "optim/adamw.h"
#include "optim/adamw_cuda.h"
#include "optim/train_state.h"

namespace deltamoe {

class DeviceTrainState : public TrainStateStore {
 public:
  DeviceTrainState(const std::vector<DeviceParamSpec>& specs, const AdamWConfig& adamw, cudaStream_t stream);
  ~DeviceTrainState() override;
  DeviceTrainState(const DeviceTrainState&) = delete;
  DeviceTrainState& operator=(const DeviceTrainState&) = delete;

  DeviceParams& params() { return *params_; }
  const DeviceParams& params() const { return *params_; }
  size_t moment_bytes() const { return exp_avg_.bytes() + exp_avg_sq_.bytes(); }

  // Queues the gradient's sum of squares (divided by divisor first) into a device double and
  // starts its copy to pinned host memory; finish_sum_of_squares() waits for it (the step's one
  // host sync: the norm decides whether and how much to clip).
  void start_sum_of_squares(double divisor);
  double finish_sum_of_squares();
  // One AdamW update of every trained piece (adam_step() advances), with the gradient scaled as
  // `scaling` says; the bf16 weights get bf16(master). No host sync.
  void adamw_step(double lr, const GradientScaling& scaling);

  // TrainStateStore
  const ParamLayout& layout() const override { return params_->trained_layout(); }
  const AdamWConfig& adamw_config() const override { return adamw_; }
  int64_t adam_step() const override { return adam_step_; }
  void set_adam_step(int64_t adam_step) override;
  void read_state(StateKind kind, int index, int64_t first, int64_t count, void* host) const override;
  void write_state(StateKind kind, int index, int64_t first, int64_t count, const void* host) override;
  void state_restored() override;

 private:
  void* address(StateKind kind, int index, int64_t first, int64_t count) const;

  std::unique_ptr<DeviceParams> params_;
  AdamWConfig adamw_;
  cudaStream_t stream_;
  DeviceBuffer exp_avg_, exp_avg_sq_;
  DeviceBuffer norm_scratch_;  // partial sums + the result
  double* norm_host_ = nullptr;  // pinned
  int64_t adam_step_ = 0;
  std::vector<__nv_bfloat16*> weights_of_pieces_;
};

}  // namespace deltamoe
