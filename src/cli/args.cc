// Flag parsing with declared flags, required checks and "did you mean" suggestions.
#include "cli/args.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "core/error.h"

namespace deltamoe {
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

}  // namespace

ArgParser::ArgParser(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

void ArgParser::add_option(const std::string& name, const std::string& help,
                           std::optional<std::string> default_value) {
  specs_[name] = Spec{help, std::move(default_value), false, false, false};
  order_.push_back(name);
}

void ArgParser::add_required(const std::string& name, const std::string& help) {
  specs_[name] = Spec{help, std::nullopt, true, false, false};
  order_.push_back(name);
}

void ArgParser::add_flag(const std::string& name, const std::string& help) {
  specs_[name] = Spec{help, std::string("false"), false, true, false};
  order_.push_back(name);
}

void ArgParser::add_positional(const std::string& name, const std::string& help, bool required) {
  specs_[name] = Spec{help, std::nullopt, required, false, true};
  positionals_.push_back(name);
}

std::string ArgParser::closest_name(const std::string& name) const {
  std::string best;
  size_t best_distance = 4;  // suggest only near misses
  for (const auto& [candidate, spec] : specs_) {
    if (spec.positional) continue;
    size_t distance = edit_distance(name, candidate);
    if (distance < best_distance) {
      best_distance = distance;
      best = candidate;
    }
  }
  return best;
}

bool ArgParser::parse(int argc, char** argv, int first) {
  size_t next_positional = 0;
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(usage().c_str(), stdout);
      return false;
    }
    if (arg.rfind("--", 0) == 0) {
      std::string name = arg.substr(2);
      std::optional<std::string> inline_value;
      size_t equals = name.find('=');
      if (equals != std::string::npos) {
        inline_value = name.substr(equals + 1);
        name = name.substr(0, equals);
      }
      auto it = specs_.find(name);
      if (it == specs_.end() || it->second.positional) {
        std::string suggestion = closest_name(name);
        RAISE("unknown flag --", name, " for 'deltamoe ", command_, "'",
             suggestion.empty() ? "" : " (did you mean --" + suggestion + "?)", "\n", usage());
      }
      if (it->second.is_flag) {
        std::string value = inline_value.value_or("true");
        if (!inline_value && i + 1 < argc &&
            (std::string(argv[i + 1]) == "true" || std::string(argv[i + 1]) == "false")) {
          value = argv[++i];
        }
        CHECK(value == "true" || value == "false", "flag --", name, " takes true or false, got '", value, "'");
        values_[name] = value;
      } else if (inline_value) {
        values_[name] = *inline_value;
      } else {
        CHECK(i + 1 < argc, "flag --", name, " needs a value\n", usage());
        // "--lr --max_steps 2": the value is missing, not the 2 unexpected.
        CHECK(std::string(argv[i + 1]).rfind("--", 0) != 0, "flag --", name, " needs a value, but the next argument is ",
              "the flag ", argv[i + 1], " (write --", name, "=VALUE for a value that starts with --)");
        values_[name] = argv[++i];
      }
      continue;
    }
    CHECK(next_positional < positionals_.size(), "unexpected argument '", arg, "' for 'deltamoe ",
          command_, "'\n", usage());
    values_[positionals_[next_positional++]] = arg;
  }
  for (const auto& [name, spec] : specs_) {
    if (spec.required && values_.count(name) == 0) {
      RAISE("'deltamoe ", command_, "' needs ", spec.positional ? name : "--" + name, "\n", usage());
    }
  }
  return true;
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
  if (it != values_.end()) return it->second;
  CHECK(s.default_value.has_value(), "'deltamoe ", command_, "': --", name, " was not given");
  return *s.default_value;
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

double ArgParser::get_double(const std::string& name) const {
  std::string text = get(name);
  try {
    size_t used = 0;
    double value = std::stod(text, &used);
    if (used == text.size() && std::isfinite(value)) return value;
  } catch (const std::exception&) {
  }
  RAISE("--", name, " must be a finite number, got '", text, "'");
}

bool ArgParser::flag(const std::string& name) const { return get(name) == "true"; }

std::string ArgParser::usage() const {
  std::ostringstream out;
  out << "usage: deltamoe " << command_;
  for (const std::string& name : positionals_) out << (specs_.at(name).required ? " " : " [") << name
                                                  << (specs_.at(name).required ? "" : "]");
  out << " [flags]\n  " << summary_ << "\n";
  for (const std::string& name : positionals_) out << "  " << name << "\n      " << specs_.at(name).help << "\n";
  for (const std::string& name : order_) {
    const Spec& s = specs_.at(name);
    out << "  --" << name << (s.is_flag ? "" : " VALUE");
    if (s.required) out << "  (required)";
    else if (s.default_value && !s.is_flag) out << "  (default: " << *s.default_value << ")";
    out << "\n      " << s.help << "\n";
  }
  return out.str();
}

}  // namespace deltamoe
