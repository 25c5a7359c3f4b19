// DataPosition <-> JSON.
#include "data/data_position.h"

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace deltamoe {

std::string data_position_to_json(const DataPosition& position) {
  nlohmann::ordered_json json;
  json["epoch"] = position.epoch;
  json["next_slot"] = position.next_slot;
  json["pending_slots"] = position.pending_slots;
  json["num_samples"] = position.num_samples;
  json["seed"] = position.seed;
  json["shuffle"] = position.shuffle;
  return json.dump();
}

DataPosition data_position_from_json(const std::string& text, const std::string& where) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& error) {
    RAISE(where, ": data position is not valid JSON: ", error.what());
  }
  DataPosition position;
  try {
    position.epoch = json.at("epoch").get<int64_t>();
    position.next_slot = json.at("next_slot").get<int64_t>();
    position.pending_slots = json.at("pending_slots").get<std::vector<int64_t>>();
    position.num_samples = json.at("num_samples").get<int64_t>();
    position.seed = json.at("seed").get<uint64_t>();
    position.shuffle = json.at("shuffle").get<bool>();
  } catch (const nlohmann::json::exception& error) {
    RAISE(where, ": data position needs integer epoch, next_slot, num_samples, seed, a list pending_slots and a bool "
          "shuffle: ", error.what());
  }
  CHECK(position.epoch >= 0 && position.next_slot >= 0 && position.num_samples >= 0 && position.next_slot <= position.num_samples,
        where, ": data position out of range (epoch ", position.epoch, ", next_slot ", position.next_slot, " of ",
        position.num_samples, ")");
  for (const int64_t slot : position.pending_slots) {
    CHECK(slot >= 0 && slot < position.next_slot, where, ": pending slot ", slot, " is not below next_slot ", position.next_slot);
  }
  return position;
}

}  // namespace deltamoe
