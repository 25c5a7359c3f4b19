// HostTrainState: range copies in and out of the host master buffer and the AdamW moments.
#include "optim/host_train_state.h"

#include <cstring>

#include "core/error.h"

namespace deltamoe {

const char* state_kind_name(StateKind kind) {
  switch (kind) {
    case StateKind::master: return "master";
    case StateKind::exp_avg: return "exp_avg";
    case StateKind::exp_avg_sq: return "exp_avg_sq";
  }
  return "?";
}

HostTrainState::HostTrainState(const ParamLayout& layout, const AdamWConfig& config)
    : optimizer_(layout, config), master_(static_cast<size_t>(layout.total_numel()), 0.0f) {}

uint8_t* HostTrainState::address(StateKind kind, int index, int64_t first, int64_t count) const {
  const ParamEntry& entry = layout().entry(index);
  CHECK(first >= 0 && count >= 0 && first + count <= entry.numel, "train state: elements [", first, ", ",
        first + count, ") are outside piece '", entry.name, "' of ", entry.numel);
  const int64_t element = entry.offset + first;
  switch (kind) {
    case StateKind::master: return reinterpret_cast<uint8_t*>(const_cast<float*>(master_.data() + element));
    case StateKind::exp_avg:
      return static_cast<uint8_t*>(optimizer_.exp_avg().data) + element * dtype_size(adamw_config().moment_dtype);
    case StateKind::exp_avg_sq:
      return static_cast<uint8_t*>(optimizer_.exp_avg_sq().data) + element * dtype_size(adamw_config().moment_dtype);
  }
  RAISE("train state: unknown state kind");
}

void HostTrainState::read_state(StateKind kind, int index, int64_t first, int64_t count, void* host) const {
  std::memcpy(host, address(kind, index, first, count),
              static_cast<size_t>(count) * dtype_size(state_dtype(kind, adamw_config())));
}

void HostTrainState::write_state(StateKind kind, int index, int64_t first, int64_t count, const void* host) {
  std::memcpy(address(kind, index, first, count), host,
              static_cast<size_t>(count) * dtype_size(state_dtype(kind, adamw_config())));
}

}  // namespace deltamoe
