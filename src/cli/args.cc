// Flag parsing: a first pass resolves names (declared, aliases, other tools' flags, unknown ones with a
// suggestion) and groups values by each flag's kind, collecting every problem; CLI11 then binds the
// normalised tokens to the declared options; last, every value is checked against its kind.
#include "cli/args.h"

#include <CLI/CLI.hpp>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/json_depth.h"

namespace deltamoe {

// Every problem of a command line, one line each; refusals that share a reason share a line
// ("--lora_rank, --lora_alpha: LoRA is not supported yet ...").
struct ArgParser::Problems {
  std::vector<std::string> lines;
  std::vector<std::pair<std::string, std::string>> refusals;  // (flags, reason)
  void add(std::string line) {
    if (std::find(lines.begin(), lines.end(), line) == lines.end()) lines.push_back(std::move(line));
  }
  void refuse(const std::string& flag, const std::string& reason) {
    for (auto& [flags, known] : refusals) {
      if (known == reason) {
        if (flags.find(flag) == std::string::npos) flags += ", " + flag;
        return;
      }
    }
    refusals.emplace_back(flag, reason);
  }
  std::vector<std::string> all() const {
    std::vector<std::string> out = lines;
    for (const auto& [flags, reason] : refusals) out.push_back(flags + ": " + reason);
    return out;
  }
};

namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

bool is_flag_token(const std::string& token) { return token.size() > 2 && token.rfind("--", 0) == 0; }

const char* kind_name(ArgKind kind) {
  switch (kind) {
    case ArgKind::kText: return "TEXT";
    case ArgKind::kInteger: return "INT";
    case ArgKind::kNumber: return "NUMBER";
    case ArgKind::kBool: return "BOOL";
    case ArgKind::kList: return "VALUE";
  }
  return "VALUE";
}

// Splits list values on commas too ("a.jsonl,b.jsonl" as before), dropping empty entries.
std::vector<std::string> split_list_values(const std::vector<std::string>& values) {
  std::vector<std::string> out;
  for (const std::string& value : values) {
    size_t start = 0;
    while (start <= value.size()) {
      const size_t comma = std::min(value.find(',', start), value.size());
      if (comma > start) out.push_back(value.substr(start, comma - start));
      start = comma + 1;
    }
  }
  return out;
}

// One config value as flag values: scalars as text, sequences as several values.
std::vector<std::string> yaml_values(const YAML::Node& node, const std::string& key, const std::string& path,
                                     std::vector<std::string>& errors) {
  if (node.IsScalar()) return {node.Scalar()};
  if (node.IsNull()) return {};
  if (node.IsSequence()) {
    std::vector<std::string> values;
    for (const YAML::Node& item : node) {
      if (!item.IsScalar()) {
        errors.push_back(str_cat("--config ", path, ": '", key, "' must be a value or a list of values"));
        return {};
      }
      values.push_back(item.Scalar());
    }
    return values;
  }
  errors.push_back(str_cat("--config ", path, ": '", key, "' must be a value or a list of values, not a mapping"));
  return {};
}

std::vector<std::string> json_values(const nlohmann::ordered_json& value, const std::string& key,
                                     const std::string& path, std::vector<std::string>& errors) {
  const auto scalar = [](const nlohmann::ordered_json& item) -> std::optional<std::string> {
    if (item.is_string()) return item.get<std::string>();
    if (item.is_boolean() || item.is_number()) return item.dump();
    return std::nullopt;
  };
  if (value.is_null()) return {};
  if (auto text = scalar(value)) return {*text};
  if (value.is_array()) {  // a list of files: "dataset": ["a.jsonl", "b.jsonl"]
    std::vector<std::string> values;
    for (const auto& item : value) {
      if (!item.is_string()) {
        errors.push_back(str_cat("--config ", path, ": '", key, "' must be a list of strings"));
        return {};
      }
      values.push_back(item.get<std::string>());
    }
    return values;
  }
  errors.push_back(str_cat("--config ", path, ": '", key, "' must be a string, number, boolean or list"));
  return {};
}

}  // namespace

std::optional<bool> parse_bool_text(const std::string& text) {
  if (text == "true" || text == "True" || text == "1") return true;
  if (text == "false" || text == "False" || text == "0") return false;
  return std::nullopt;
}

ArgParser::ArgParser(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)),
      app_(std::make_unique<CLI::App>(summary_, "deltamoe " + command_)) {
  app_->set_help_flag();  // --help is answered before CLI11 sees the tokens
}

ArgParser::~ArgParser() = default;

void ArgParser::add_option(const std::string& name, const std::string& help, std::optional<std::string> default_value,
                           ArgKind kind) {
  Spec spec;
  spec.help = help;
  spec.kind = kind;
  spec.default_value = std::move(default_value);
  specs_[name] = spec;
  order_.push_back(name);
  CLI::Option* option = app_->add_option("--" + name, help)->type_name(kind_name(kind));
  if (kind == ArgKind::kList) option->expected(1, -1);
  if (spec.default_value && !spec.default_value->empty()) option->default_str(*spec.default_value);
}

void ArgParser::add_required(const std::string& name, const std::string& help, ArgKind kind) {
  add_option(name, help + " (required)", std::nullopt, kind);
  specs_[name].required = true;
  specs_[name].help = help;
}

void ArgParser::add_bool(const std::string& name, const std::string& help, bool default_value) {
  add_option(name, help, default_value ? "true" : "false", ArgKind::kBool);
}

void ArgParser::add_list(const std::string& name, const std::string& help, bool required) {
  add_option(name, required ? help + " (required)" : help, required ? std::nullopt : std::optional<std::string>(""),
             ArgKind::kList);
  specs_[name].required = required;
  specs_[name].help = help;
}

void ArgParser::add_positional(const std::string& name, const std::string& help, bool required) {
  Spec spec;
  spec.help = help;
  spec.required = required;
  spec.positional = true;
  specs_[name] = spec;
  positionals_.push_back(name);
  app_->add_option(name, help);
}

void ArgParser::allow_values(const std::string& name, std::vector<std::string> values, const std::string& reason) {
  Spec& s = const_cast<Spec&>(spec(name));
  s.allowed_values = std::move(values);
  s.allowed_reason = reason;
}

void ArgParser::add_foreign(const ForeignFlag& flag) {
  CHECK(specs_.count(flag.name) == 0, "internal: --", flag.name, " is both a flag of 'deltamoe ", command_,
        "' and another tool's");
  CHECK(flag.action != ForeignFlag::Action::kAlias || specs_.count(flag.target) == 1, "internal: alias --", flag.name,
        " names an undeclared flag --", flag.target);
  foreign_[flag.name] = flag;
}

void ArgParser::enable_config_file() {
  config_file_ = true;
  add_option("config", "YAML or JSON file of flags ({lr: 1e-4, dataset: [a.jsonl]}); the command line wins", "");
}

std::string ArgParser::closest_name(const std::string& name) const {
  std::string best;
  size_t best_distance = 4;  // suggest only near misses
  const auto consider = [&](const std::string& candidate) {
    const size_t distance = edit_distance(name, candidate);
    if (distance < best_distance) {
      best_distance = distance;
      best = candidate;
    }
  };
  for (const auto& [candidate, spec] : specs_) {
    if (!spec.positional) consider(candidate);
  }
  for (const auto& [candidate, flag] : foreign_) {
    if (flag.action != ForeignFlag::Action::kRefused) consider(candidate);
  }
  return best;
}

std::vector<std::string> ArgParser::read_config_file(const std::string& path, Problems& problems) const {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) {
    problems.add(str_cat("--config: cannot read ", path));
    return {};
  }
  std::stringstream text;
  text << in.rdbuf();
  std::vector<std::string> errors;
  std::vector<std::pair<std::string, std::vector<std::string>>> entries;
  const bool json = path.size() >= 5 && path.substr(path.size() - 5) == ".json";
  if (json) {
    nlohmann::ordered_json root;
    try {
      CHECK(json_nesting_depth(text.str()) <= kMaxJsonDepth, "nested too deeply");
      root = nlohmann::ordered_json::parse(text.str());
    } catch (const std::exception& error) {
      problems.add(str_cat("--config ", path, ": not valid JSON (", error.what(), ")"));
      return {};
    }
    if (!root.is_object()) {
      problems.add(str_cat("--config ", path, ": must hold one JSON object of flag names and values"));
      return {};
    }
    for (const auto& [key, value] : root.items()) entries.emplace_back(key, json_values(value, key, path, errors));
  } else {
    YAML::Node root;
    try {
      root = YAML::Load(text.str());
    } catch (const YAML::Exception& error) {
      problems.add(str_cat("--config ", path, ": not valid YAML (line ", error.mark.line + 1, ": ", error.msg, ")"));
      return {};
    }
    if (!root.IsMap()) {
      problems.add(str_cat("--config ", path, ": must hold a mapping of flag names to values (name: value)"));
      return {};
    }
    for (const auto& entry : root) {
      const std::string key = entry.first.Scalar();
      entries.emplace_back(key, yaml_values(entry.second, key, path, errors));
    }
  }
  for (std::string& error : errors) problems.add(std::move(error));
  std::vector<std::string> tokens;
  for (const auto& [key, values] : entries) {
    if (key == "config") {
      problems.add(str_cat("--config ", path, ": cannot name another config file"));
      continue;
    }
    if (values.empty()) continue;  // null: the default
    tokens.push_back("--" + key);
    tokens.insert(tokens.end(), values.begin(), values.end());
  }
  return tokens;
}

// Resolves each flag token (declared, alias, other tool's, unknown), groups its values by kind, and
// returns the tokens CLI11 binds: "--name=value" per value, later occurrences replacing earlier ones.
std::vector<std::string> ArgParser::normalise(const std::vector<std::string>& tokens, Problems& problems) {
  std::vector<std::string> positional_tokens;
  std::map<std::string, std::vector<std::string>> given;
  std::map<std::string, std::string> given_as;  // flag -> the name it was given under (for conflicts)
  std::vector<std::string> given_order;
  const auto record = [&](const std::string& name, const std::string& as, std::vector<std::string> values) {
    auto it = given.find(name);
    if (it != given.end() && given_as[name] != as && it->second != values) {
      problems.add(str_cat("--", as, " and --", given_as[name], " both set --", name, " (", as, " is an alias); give one"));
      return;
    }
    if (it == given.end()) given_order.push_back(name);
    given[name] = std::move(values);
    given_as[name] = as;
  };
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string& token = tokens[i];
    if (!is_flag_token(token)) {
      positional_tokens.push_back(token);
      continue;
    }
    std::string name = token.substr(2);
    std::optional<std::string> inline_value;
    if (const size_t equals = name.find('='); equals != std::string::npos) {
      inline_value = name.substr(equals + 1);
      name = name.substr(0, equals);
    }
    // transformers' parser takes --learning-rate as well as --learning_rate.
    if (specs_.count(name) == 0 && foreign_.count(name) == 0) std::replace(name.begin(), name.end(), '-', '_');
    const auto spec_it = specs_.find(name);
    const auto foreign_it = foreign_.find(name);
    const bool declared = spec_it != specs_.end() && !spec_it->second.positional;
    if (!declared && foreign_it == foreign_.end()) {
      const std::string suggestion = closest_name(name);
      problems.add(str_cat("unknown flag --", name, suggestion.empty() ? "" : " (did you mean --" + suggestion + "?)"));
      // Its value would otherwise read as a stray argument; commands with positionals keep them.
      if (!inline_value && positionals_.empty()) {
        while (i + 1 < tokens.size() && !is_flag_token(tokens[i + 1])) ++i;
      }
      continue;
    }
    const ArgKind kind = declared ? spec_it->second.kind : foreign_it->second.kind;
    std::vector<std::string> values;
    if (inline_value) {
      values.push_back(*inline_value);
    } else if (kind == ArgKind::kBool) {
      // A bare --freeze_vit means true; "--freeze_vit maybe" is a bad value, not a stray argument,
      // unless the command takes positional arguments.
      const bool next_is_value = i + 1 < tokens.size() && !is_flag_token(tokens[i + 1]) &&
                                 (parse_bool_text(tokens[i + 1]) || positionals_.empty());
      values.push_back(next_is_value ? tokens[++i] : "true");
    } else if (kind == ArgKind::kList) {
      while (i + 1 < tokens.size() && !is_flag_token(tokens[i + 1])) values.push_back(tokens[++i]);
      if (values.empty()) {
        problems.add(str_cat("flag --", name, " needs at least one value", i + 1 < tokens.size()
                                 ? str_cat(", but the next argument is the flag ", tokens[i + 1]) : std::string()));
        continue;
      }
    } else if (i + 1 >= tokens.size()) {
      problems.add(str_cat("flag --", name, " needs a value"));
      continue;
    } else if (is_flag_token(tokens[i + 1])) {
      // "--lr --max_steps 2": the value is missing, not the 2 unexpected.
      problems.add(str_cat("flag --", name, " needs a value, but the next argument is the flag ", tokens[i + 1],
                           " (write --", name, "=VALUE for a value that starts with --)"));
      continue;
    } else {
      values.push_back(tokens[++i]);
    }
    if (declared) {
      record(name, name, std::move(values));
      continue;
    }
    const ForeignFlag& flag = foreign_it->second;
    switch (flag.action) {
      case ForeignFlag::Action::kAlias:
        record(flag.target, name, std::move(values));
        break;
      case ForeignFlag::Action::kRefused:
        problems.refuse("--" + name, flag.reason);
        break;
      case ForeignFlag::Action::kNoEffect: {
        bool harmless = true;
        for (const std::string& value : values) {
          if (!flag.harmless_values.empty() &&
              std::find(flag.harmless_values.begin(), flag.harmless_values.end(), value) == flag.harmless_values.end()) {
            harmless = false;
            problems.refuse(str_cat("--", name, " ", value), flag.refused_reason);
          }
        }
        if (harmless) {
          std::string shown;
          for (const std::string& value : values) shown += " " + value;
          const std::string note = str_cat("--", name, shown, ": no effect in deltamoe (", flag.reason, ")");
          if (std::find(notes_.begin(), notes_.end(), note) == notes_.end()) notes_.push_back(note);
        }
        break;
      }
    }
  }
  std::vector<std::string> out;
  for (const std::string& name : given_order) {
    for (const std::string& value : given[name]) out.push_back("--" + name + "=" + value);
  }
  out.insert(out.end(), positional_tokens.begin(), positional_tokens.end());
  return out;
}

void ArgParser::check_values(Problems& problems) const {
  for (const std::string& name : order_) {
    const Spec& s = specs_.at(name);
    auto it = values_.find(name);
    if (it == values_.end()) {
      if (s.required) problems.add(str_cat("'deltamoe ", command_, "' needs --", name, " (", s.help, ")"));
      continue;
    }
    for (const std::string& value : it->second) {
      switch (s.kind) {
        case ArgKind::kInteger: {
          bool ok = false;
          try {
            size_t used = 0;
            (void)std::stoll(value, &used);
            ok = used == value.size();
          } catch (const std::exception&) {
          }
          if (!ok) problems.add(str_cat("--", name, " must be an integer, got '", value, "'"));
          break;
        }
        case ArgKind::kNumber: {
          bool ok = false;
          try {
            size_t used = 0;
            const double number = std::stod(value, &used);
            ok = used == value.size() && std::isfinite(number);
          } catch (const std::exception&) {
          }
          if (!ok) problems.add(str_cat("--", name, " must be a finite number, got '", value, "'"));
          break;
        }
        case ArgKind::kBool:
          if (!parse_bool_text(value)) problems.add(str_cat("--", name, " takes true or false, got '", value, "'"));
          break;
        case ArgKind::kText:
        case ArgKind::kList:
          break;
      }
      if (!s.allowed_values.empty() &&
          std::find(s.allowed_values.begin(), s.allowed_values.end(), value) == s.allowed_values.end()) {
        problems.add(str_cat("--", name, " ", value, " ", s.allowed_reason));
      }
    }
  }
  for (const std::string& name : positionals_) {
    if (specs_.at(name).required && values_.count(name) == 0) {
      problems.add(str_cat("'deltamoe ", command_, "' needs ", name, " (", specs_.at(name).help, ")"));
    }
  }
}

bool ArgParser::parse(int argc, char** argv, int first) {
  std::vector<std::string> tokens(argv + std::min(first, argc), argv + argc);
  for (const std::string& token : tokens) {
    if (token == "--help" || token == "-h") {
      std::fputs(usage().c_str(), stdout);
      return false;
    }
  }
  Problems problems;
  std::vector<std::string> all_tokens;
  if (config_file_) {
    // --config FILE is read first: its flags come before the command line's, so the command line wins.
    std::vector<std::string> rest;
    std::string config_path;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] == "--config" && i + 1 < tokens.size()) {
        config_path = tokens[++i];
      } else if (tokens[i].rfind("--config=", 0) == 0) {
        config_path = tokens[i].substr(9);
      } else {
        rest.push_back(tokens[i]);
      }
    }
    if (!config_path.empty()) {
      all_tokens = read_config_file(config_path, problems);
      values_["config"] = {config_path};
    }
    all_tokens.insert(all_tokens.end(), rest.begin(), rest.end());
  } else {
    all_tokens = tokens;
  }
  std::vector<std::string> normalised = normalise(all_tokens, problems);

  // CLI11 binds the normalised tokens; what it still refuses (extra positionals) is one more problem.
  std::vector<std::string> cli_args;
  cli_args.push_back("deltamoe " + command_);
  cli_args.insert(cli_args.end(), normalised.begin(), normalised.end());
  std::vector<char*> cli_argv;
  for (std::string& arg : cli_args) cli_argv.push_back(arg.data());
  try {
    app_->parse(static_cast<int>(cli_argv.size()), cli_argv.data());
  } catch (const CLI::ExtrasError&) {
    for (const std::string& extra : app_->remaining()) {
      problems.add(str_cat("unexpected argument '", extra, "'"));
    }
  } catch (const CLI::ParseError& error) {
    problems.add(error.what());
  }
  for (const auto& [name, spec] : specs_) {
    const CLI::Option* option = spec.positional ? app_->get_option_no_throw(name) : app_->get_option_no_throw("--" + name);
    if (option == nullptr || option->count() == 0) continue;
    std::vector<std::string> results = option->results();
    if (spec.kind != ArgKind::kList && results.size() > 1) results = {results.back()};  // the command line wins
    values_[name] = spec.kind == ArgKind::kList ? split_list_values(results) : results;
  }
  check_values(problems);
  const std::vector<std::string> lines = problems.all();
  if (lines.empty()) return true;
  std::string message;
  if (lines.size() == 1) {
    message = str_cat("'deltamoe ", command_, "': ", lines[0]);
  } else {
    message = str_cat("'deltamoe ", command_, "': ", lines.size(), " problems with the flags:");
    for (const std::string& line : lines) message += "\n  " + line;
  }
  message += str_cat("\n('deltamoe ", command_, " --help' lists the flags)");
  RAISE(message);
}

const ArgParser::Spec& ArgParser::spec(const std::string& name) const {
  auto it = specs_.find(name);
  CHECK(it != specs_.end(), "internal: flag '", name, "' was never declared for ", command_);
  return it->second;
}

bool ArgParser::has(const std::string& name) const {
  spec(name);
  return values_.count(name) != 0;
}

std::string ArgParser::get(const std::string& name) const {
  const Spec& s = spec(name);
  auto it = values_.find(name);
  if (it != values_.end()) {
    if (s.kind != ArgKind::kList) return it->second.back();
    std::string joined;
    for (const std::string& value : it->second) joined += (joined.empty() ? "" : ",") + value;
    return joined;
  }
  CHECK(s.default_value.has_value(), "'deltamoe ", command_, "': --", name, " was not given");
  return *s.default_value;
}

std::vector<std::string> ArgParser::get_list(const std::string& name) const {
  const Spec& s = spec(name);
  auto it = values_.find(name);
  if (it != values_.end()) return it->second;
  return s.default_value ? split_list_values({*s.default_value}) : std::vector<std::string>{};
}

int64_t ArgParser::get_int(const std::string& name) const {
  std::string text = get(name);
  try {
    size_t used = 0;
    int64_t value = std::stoll(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  RAISE("--", name, " must be an integer, got '", text, "'");
}

static double get_double_of(const std::string& name, const std::string& text) {
  try {
    size_t used = 0;
    double value = std::stod(text, &used);
    if (used == text.size() && std::isfinite(value)) return value;
  } catch (const std::exception&) {
  }
  RAISE("--", name, " must be a finite number, got '", text, "'");
}

double ArgParser::get_double(const std::string& name) const { return get_double_of(name, get(name)); }

bool ArgParser::flag(const std::string& name) const {
  const std::string text = get(name);
  const std::optional<bool> value = parse_bool_text(text);
  CHECK(value.has_value(), "--", name, " takes true or false, got '", text, "'");
  return *value;
}

nlohmann::ordered_json ArgParser::given_flags() const {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const std::string& name : order_) {
    if (values_.count(name) == 0) continue;
    const Spec& s = specs_.at(name);
    switch (s.kind) {
      case ArgKind::kInteger: out[name] = get_int(name); break;
      case ArgKind::kNumber: out[name] = get_double(name); break;
      case ArgKind::kBool: out[name] = flag(name); break;
      case ArgKind::kList: out[name] = get_list(name); break;
      case ArgKind::kText: out[name] = get(name); break;
    }
  }
  return out;
}

std::string ArgParser::usage() const {
  std::string text = app_->help();
  if (!foreign_.empty()) {
    text += "\nFlags of ms-swift, Megatron-LM and transformers are taken where they mean the same (aliases) or change "
            "nothing here (noted); the others are refused with the reason (docs/swift_compat.md).\n";
  }
  return text;
}

}  // namespace deltamoe
