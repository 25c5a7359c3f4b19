// Command-line flags for deltamoe subcommands, parsed with CLI11: each command declares its flags
// with a kind, and every unknown, misplaced or malformed flag on a command line (or in a --config
// file) is reported at once, one line each with a hint, before any work starts.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace CLI {
class App;
}

namespace deltamoe {

// What a flag's values must look like. Checked for every flag before the command runs.
enum class ArgKind {
  kText,     // any string
  kInteger,  // a whole number (int64)
  kNumber,   // a finite number (NaN and infinities are refused)
  kBool,     // true/false (also True/False/1/0); a bare --flag means true
  kList,     // one or more values: --dataset a.jsonl b.jsonl (commas also split)
};

// A flag of another tool (ms-swift, Megatron-LM, transformers) and what deltamoe does with it.
struct ForeignFlag {
  enum class Action {
    kAlias,     // the same meaning as the deltamoe flag `target`
    kNoEffect,  // accepted; changes nothing here (`reason` says why), noted once
    kRefused,   // deltamoe cannot honour it: `reason` says why and what to do instead
  };
  std::string name;
  Action action = Action::kNoEffect;
  ArgKind kind = ArgKind::kText;  // how many values follow it on a command line
  std::string target;             // kAlias only
  std::string reason;
  // kNoEffect only: the values that change nothing ("bfloat16", "1", "true"); any other value is
  // refused with `refused_reason`. Empty: every value is accepted.
  std::vector<std::string> harmless_values;
  std::string refused_reason;
};

class ArgParser {
 public:
  ArgParser(std::string command, std::string summary);
  ~ArgParser();
  ArgParser(const ArgParser&) = delete;
  ArgParser& operator=(const ArgParser&) = delete;

  // --name VALUE (or --name=VALUE). A default makes the option optional.
  void add_option(const std::string& name, const std::string& help,
                  std::optional<std::string> default_value = std::nullopt, ArgKind kind = ArgKind::kText);
  // --name VALUE that must be given.
  void add_required(const std::string& name, const std::string& help, ArgKind kind = ArgKind::kText);
  // --name [true|false]: a bare --name means true.
  void add_bool(const std::string& name, const std::string& help, bool default_value);
  void add_flag(const std::string& name, const std::string& help) { add_bool(name, help, false); }
  // --name V1 V2 ... (space separated until the next flag; commas also separate).
  void add_list(const std::string& name, const std::string& help, bool required = false);
  // A positional argument (in declaration order).
  void add_positional(const std::string& name, const std::string& help, bool required);
  // Restricts a declared flag's values; any other is refused with `reason`.
  void allow_values(const std::string& name, std::vector<std::string> values, const std::string& reason);
  // Names of other tools: aliases, flags with no effect here, and refusals (see ForeignFlag).
  void add_foreign(const ForeignFlag& flag);
  // --config FILE (YAML, or JSON by the .json extension): its keys are flag names, placed before
  // the command line's flags so that the command line wins.
  void enable_config_file();

  // Parses argv[first..argc). Throws deltamoe::Error listing every problem (one line each) on a bad
  // command line. Returns false when --help was asked for (the flags are printed).
  bool parse(int argc, char** argv, int first = 2);

  // Whether the command has a flag of that name.
  bool declares(const std::string& name) const { return specs_.count(name) != 0; }
  // Whether the flag was given (command line or config file), not only defaulted.
  bool has(const std::string& name) const;
  std::string get(const std::string& name) const;
  std::vector<std::string> get_list(const std::string& name) const;
  int64_t get_int(const std::string& name) const;
  double get_double(const std::string& name) const;
  bool flag(const std::string& name) const;
  // What the no-effect flags of this command line mean here, one line each (for the log).
  const std::vector<std::string>& notes() const { return notes_; }
  // The flags as given: {"lr": 0.0001, "dataset": ["a.jsonl"], ...} with typed values.
  nlohmann::ordered_json given_flags() const;
  std::string usage() const;

 private:
  struct Spec {
    std::string help;
    ArgKind kind = ArgKind::kText;
    std::optional<std::string> default_value;
    bool required = false;
    bool positional = false;
    std::vector<std::string> allowed_values;
    std::string allowed_reason;
  };
  struct Problems;
  const Spec& spec(const std::string& name) const;
  std::string closest_name(const std::string& name) const;
  std::vector<std::string> read_config_file(const std::string& path, Problems& problems) const;
  std::vector<std::string> normalise(const std::vector<std::string>& tokens, Problems& problems);
  void check_values(Problems& problems) const;

  std::string command_;
  std::string summary_;
  bool config_file_ = false;
  std::vector<std::string> order_;
  std::vector<std::string> positionals_;
  std::map<std::string, Spec> specs_;
  std::map<std::string, ForeignFlag> foreign_;
  std::map<std::string, std::vector<std::string>> values_;  // given flags (text values)
  std::vector<std::string> notes_;
  std::unique_ptr<CLI::App> app_;
};

// "true"/"True"/"1" -> true, "false"/"False"/"0" -> false, else nullopt.
std::optional<bool> parse_bool_text(const std::string& text);

}  // namespace deltamoe
