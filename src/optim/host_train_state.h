// HostTrainState: a TrainStateStore in host memory — the flat fp32 master buffer of a ParamLayout and
// the CPU AdamW that owns its moments. The CPU engine trains with it; tests use it as the plain
// reference state.
#pragma once

#include <functional>
#include <utility>
#include <vector>

#include "optim/adamw.h"
#include "optim/train_state.h"

namespace deltamoe {

class HostTrainState : public TrainStateStore {
 public:
  // Master weights start at zero (fill them through master() or write_state).
  HostTrainState(const ParamLayout& layout, const AdamWConfig& config);

  const ParamLayout& layout() const override { return optimizer_.layout(); }
  const AdamWConfig& adamw_config() const override { return optimizer_.config(); }
  int64_t adam_step() const override { return optimizer_.adam_step(); }
  void set_adam_step(int64_t adam_step) override { optimizer_.set_adam_step(adam_step); }
  void read_state(StateKind kind, int index, int64_t first, int64_t count, void* host) const override;
  void write_state(StateKind kind, int index, int64_t first, int64_t count, const void* host) override;
  void state_restored() override {
    if (on_restored_) on_restored_();
  }
  // Called by state_restored(), e.g. so that an engine's model picks up the restored master.
  void set_restore_hook(std::function<void()> hook) { on_restored_ = std::move(hook); }

  // layout().total_numel() fp32 values (padding zero).
  std::vector<float>& master() { return master_; }
  const std::vector<float>& master() const { return master_; }
  AdamW& optimizer() { return optimizer_; }
  const AdamW& optimizer() const { return optimizer_; }

 private:
  // Byte address of element `first` of piece `index` in the buffer of `kind`.
  uint8_t* address(StateKind kind, int index, int64_t first, int64_t count) const;

  AdamW optimizer_;
  std::vector<float> master_;
  std::function<void()> on_restored_;
};

}  // namespace deltamoe
