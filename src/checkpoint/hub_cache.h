// `--model ORG/NAME` (a hub id, as ms-swift and transformers take it) found in the local caches that
// `huggingface-cli download` and `modelscope download` fill; deltamoe never downloads.
#pragma once

#include <functional>
#include <string>

namespace deltamoe {

// ORG/NAME with a single '/', no path prefix (., /, ~) and hub characters only.
bool looks_like_hub_id(const std::string& spec);

// spec itself when it is an existing directory or does not look like a hub id. For a hub id, the
// cached snapshot with a config.json: Hugging Face (HF_HUB_CACHE, else HF_HOME/hub, else
// ~/.cache/huggingface/hub; models--ORG--NAME/snapshots/<refs/main>) first, then ModelScope
// (MODELSCOPE_CACHE, else ~/.cache/modelscope/hub; models/ORG/NAME with '.' written '___', or
// ORG/NAME). Throws naming the places looked at and the download commands when it is in neither.
// `getenv` reads the environment (the process's by default).
std::string resolve_model_dir(const std::string& spec, const std::function<const char*(const char*)>& getenv = nullptr);

}  // namespace deltamoe
