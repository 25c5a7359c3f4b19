// TrainStateStore: the training state of the tensor pieces one engine trains (fp32 master weights
// and AdamW moments over a ParamLayout), as seen by whoever saves or restores it. The engine owns
// the state on its device; these calls copy one range at a time between it and host memory, which
// are the only host copies of the state (checkpoint writing and --resume).
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "optim/adamw.h"
#include "optim/param_layout.h"

namespace deltamoe {

enum class StateKind { master, exp_avg, exp_avg_sq };
constexpr StateKind kStateKinds[] = {StateKind::master, StateKind::exp_avg, StateKind::exp_avg_sq};
const char* state_kind_name(StateKind kind);  // "master", "exp_avg", "exp_avg_sq"

class TrainStateStore {
 public:
  virtual ~TrainStateStore() = default;

  // The trained pieces (tensor, element range) and where each lives in the flat buffers.
  virtual const ParamLayout& layout() const = 0;
  virtual const AdamWConfig& adamw_config() const = 0;
  // Updates applied so far (torch's state['step']).
  virtual int64_t adam_step() const = 0;
  virtual void set_adam_step(int64_t adam_step) = 0;

  // Copies `count` elements of piece `index` starting at element `first` of the piece (master f32,
  // moments in adamw_config().moment_dtype) to or from host memory. Synchronous.
  virtual void read_state(StateKind kind, int index, int64_t first, int64_t count, void* host) const = 0;
  virtual void write_state(StateKind kind, int index, int64_t first, int64_t count, const void* host) = 0;
  // After a restore: copies derived from the master (the bf16 working weights) are rebuilt.
  virtual void state_restored() = 0;
};

// The element type `kind` is stored in.
inline DType state_dtype(StateKind kind, const AdamWConfig& config) {
  return kind == StateKind::master ? DType::f32 : config.moment_dtype;
}

}  // namespace deltamoe
