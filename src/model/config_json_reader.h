// Typed, defaulted reads of config.json fields: a wrong JSON type or an out-of-range value is an
// error naming the file and the field path (e.g. "config.json: text_config.hidden_size: ...").
// Internal to src/model (config.cc); includes nlohmann/json, so only .cc files include it.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"

namespace deltamoe {

class JsonFieldReader {
 public:
  // `object` must outlive the reader; `path` is the field prefix ("" or "text_config").
  JsonFieldReader(const nlohmann::json& object, std::string where, std::string path)
      : object_(object), where_(std::move(where)), path_(std::move(path)) {}

  bool has(const std::string& key) const { return object_.contains(key) && !object_.at(key).is_null(); }
  std::string field(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  const std::string& where() const { return where_; }

  // Integer >= min_value; `fallback` when absent or null.
  int64_t get_int(const std::string& key, int64_t fallback, int64_t min_value = 1) const {
    if (!has(key)) return fallback;
    const nlohmann::json& value = object_.at(key);
    CHECK(value.is_number_integer(), where_, ": ", field(key), " must be an integer, got ", value.dump());
    int64_t result = value.get<int64_t>();
    CHECK(result >= min_value, where_, ": ", field(key), " must be >= ", min_value, ", got ", result);
    return result;
  }
  std::optional<int64_t> get_optional_int(const std::string& key) const {
    if (!has(key)) return std::nullopt;
    const nlohmann::json& value = object_.at(key);
    // eos_token_id may be a list; the first entry is the one the model config cares about.
    if (value.is_array() && !value.empty()) {
      CHECK(value[0].is_number_integer(), where_, ": ", field(key), " must hold integers, got ", value.dump());
      return value[0].get<int64_t>();
    }
    CHECK(value.is_number_integer(), where_, ": ", field(key), " must be an integer, got ", value.dump());
    return value.get<int64_t>();
  }
  double get_double(const std::string& key, double fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& value = object_.at(key);
    CHECK(value.is_number(), where_, ": ", field(key), " must be a number, got ", value.dump());
    return value.get<double>();
  }
  bool get_bool(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& value = object_.at(key);
    CHECK(value.is_boolean(), where_, ": ", field(key), " must be true or false, got ", value.dump());
    return value.get<bool>();
  }
  std::string get_string(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& value = object_.at(key);
    CHECK(value.is_string(), where_, ": ", field(key), " must be a string, got ", value.dump());
    return value.get<std::string>();
  }
  std::vector<int64_t> get_int_list(const std::string& key, std::vector<int64_t> fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& value = object_.at(key);
    CHECK(value.is_array(), where_, ": ", field(key), " must be a list of integers, got ", value.dump());
    std::vector<int64_t> result;
    for (const nlohmann::json& item : value) {
      CHECK(item.is_number_integer(), where_, ": ", field(key), " must be a list of integers, got ", value.dump());
      result.push_back(item.get<int64_t>());
    }
    return result;
  }
  // A nested object (or nullptr when absent/null); errors if present but not an object.
  const nlohmann::json* get_object(const std::string& key) const {
    if (!has(key)) return nullptr;
    const nlohmann::json& value = object_.at(key);
    CHECK(value.is_object(), where_, ": ", field(key), " must be an object, got ", value.dump());
    return &value;
  }

 private:
  const nlohmann::json& object_;
  std::string where_;
  std::string path_;
};

}  // namespace deltamoe
