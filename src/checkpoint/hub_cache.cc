// Hub ids resolved from the local Hugging Face and ModelScope caches (see hub_cache.h).
#include "checkpoint/hub_cache.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/error.h"

namespace deltamoe {

namespace fs = std::filesystem;

namespace {

bool is_model_dir(const fs::path& dir) { return fs::is_regular_file(dir / "config.json"); }

// models--ORG--NAME/snapshots/<hash>: the one refs/main names, else the newest with a config.json.
std::string hf_snapshot(const fs::path& cache, const std::string& org, const std::string& name) {
  const fs::path repo = cache / ("models--" + org + "--" + name);
  if (!fs::is_directory(repo / "snapshots")) return "";
  std::ifstream ref(repo / "refs" / "main");
  std::string hash;
  if (ref >> hash && is_model_dir(repo / "snapshots" / hash)) return (repo / "snapshots" / hash).string();
  fs::path newest;
  fs::file_time_type newest_time{};
  for (const auto& entry : fs::directory_iterator(repo / "snapshots")) {
    if (!is_model_dir(entry.path())) continue;
    const auto time = fs::last_write_time(entry.path());
    if (newest.empty() || time > newest_time) {
      newest = entry.path();
      newest_time = time;
    }
  }
  return newest.string();
}

std::string replace_all(std::string text, const std::string& from, const std::string& to) {
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
  }
  return text;
}

}  // namespace

bool looks_like_hub_id(const std::string& spec) {
  const size_t slash = spec.find('/');
  if (slash == std::string::npos || slash == 0 || slash + 1 >= spec.size() || spec.find('/', slash + 1) != std::string::npos) {
    return false;
  }
  if (spec[0] == '.' || spec[0] == '~') return false;
  for (char c : spec) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == '-' || c == '/';
    if (!ok) return false;
  }
  return true;
}

std::string resolve_model_dir(const std::string& spec, const std::function<const char*(const char*)>& getenv_fn) {
  if (fs::is_directory(spec) || !looks_like_hub_id(spec)) return spec;
  const auto env = [&](const char* name) -> std::string {
    const char* value = getenv_fn ? getenv_fn(name) : std::getenv(name);
    return value != nullptr ? value : "";
  };
  const std::string home = env("HOME");
  const std::string org = spec.substr(0, spec.find('/'));
  const std::string name = spec.substr(spec.find('/') + 1);

  fs::path hf_cache;
  if (!env("HF_HUB_CACHE").empty()) hf_cache = env("HF_HUB_CACHE");
  else if (!env("HF_HOME").empty()) hf_cache = fs::path(env("HF_HOME")) / "hub";
  else hf_cache = fs::path(home) / ".cache" / "huggingface" / "hub";
  if (const std::string found = hf_snapshot(hf_cache, org, name); !found.empty()) return found;

  fs::path ms_cache = !env("MODELSCOPE_CACHE").empty() ? fs::path(env("MODELSCOPE_CACHE"))
                                                       : fs::path(home) / ".cache" / "modelscope" / "hub";
  // ModelScope writes '.' in a model name as '___' in its folder (Qwen3.5 -> Qwen3___5); older
  // versions used the name as it is, with or without the models/ level.
  const std::vector<fs::path> ms_candidates = {ms_cache / "models" / org / replace_all(name, ".", "___"),
                                               ms_cache / "models" / org / name, ms_cache / org / name};
  for (const fs::path& candidate : ms_candidates) {
    if (is_model_dir(candidate)) return candidate.string();
  }
  RAISE("--model ", spec, ": not a directory here, and not in the local Hugging Face cache (",
        (hf_cache / ("models--" + org + "--" + name)).string(), ") or ModelScope cache (", ms_candidates[0].string(),
        "); deltamoe does not download. Download it first, then give the folder to --model:\n  huggingface-cli download ",
        spec, " --local-dir ", name, "\n  (or: modelscope download --model ", spec, " --local_dir ", name, ")");
}

}  // namespace deltamoe
