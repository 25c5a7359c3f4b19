// Command-line flags for deltamoe subcommands: each command declares its flags, so an unknown or
// malformed flag is reported (with the closest known name) before any work starts.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace deltamoe {

class ArgParser {
 public:
  ArgParser(std::string command, std::string summary);

  // --name VALUE (or --name=VALUE). A default makes the option optional.
  void add_option(const std::string& name, const std::string& help,
                  std::optional<std::string> default_value = std::nullopt);
  // --name VALUE that must be given.
  void add_required(const std::string& name, const std::string& help);
  // --name (boolean; also --name true/false).
  void add_flag(const std::string& name, const std::string& help);
  // A positional argument (in declaration order).
  void add_positional(const std::string& name, const std::string& help, bool required);

  // Parses argv[first..argc). Throws deltamoe::Error with the usage text on a bad command line.
  // Returns false when --help was asked for (usage already printed).
  bool parse(int argc, char** argv, int first = 2);

  bool has(const std::string& name) const;
  std::string get(const std::string& name) const;
  int64_t get_int(const std::string& name) const;
  double get_double(const std::string& name) const;
  bool flag(const std::string& name) const;
  std::string usage() const;

 private:
  struct Spec {
    std::string help;
    std::optional<std::string> default_value;
    bool required = false;
    bool is_flag = false;
    bool positional = false;
  };
  const Spec& spec(const std::string& name) const;
  std::string closest_name(const std::string& name) const;

  std::string command_;
  std::string summary_;
  std::vector<std::string> order_;
  std::vector<std::string> positionals_;
  std::map<std::string, Spec> specs_;
  std::map<std::string, std::string> values_;
};

}  // namespace deltamoe
