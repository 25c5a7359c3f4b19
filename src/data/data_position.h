// Where the data stream stands, for exact resume: the epoch, the next slot of the epoch's order to
// read, and the slots already read but still waiting in the packer. Saved with the trainer's
// checkpoint as JSON; restarting from it yields exactly the batches that would have followed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace deltamoe {

struct DataPosition {
  int64_t epoch = 0;
  int64_t next_slot = 0;              // slots [0, next_slot) of epoch_order(epoch) have been read
  std::vector<int64_t> pending_slots; // read, not yet in a batch, in packer order
  // Checked on resume so that a position is not applied to another dataset or shuffle.
  int64_t num_samples = -1;
  uint64_t seed = 0;
  bool shuffle = true;

  bool operator==(const DataPosition&) const = default;
};

std::string data_position_to_json(const DataPosition& position);
// Throws deltamoe::Error naming `where` for malformed text or fields.
DataPosition data_position_from_json(const std::string& text, const std::string& where);

}  // namespace deltamoe
