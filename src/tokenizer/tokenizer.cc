// Loading tokenizer.json into lookup tables, and the encode/decode pipeline:
// added tokens (raw text) -> NFC -> added tokens marked normalized -> Split -> byte-level BPE.
#include "tokenizer/tokenizer.h"

#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/unicode.h"

namespace deltamoe {

// Hash and equality that accept std::string_view, so cache and vocabulary lookups do not allocate.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
};
using StringIdMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

struct TokenizerData {
  uint64_t instance_id = 0;  // keys the per-thread piece cache
  bool nfc = false;
  SplitPattern split_pattern = SplitPattern::kQwen2;
  bool ignore_merges = false;
  StringIdMap vocab;                       // BPE vocabulary, byte-level text -> id
  std::vector<std::string> id_to_token;    // vocabulary and added tokens
  std::vector<std::string> id_to_bytes;    // what decode emits for each id
  std::vector<bool> special;
  std::vector<uint32_t> text_size;         // bytes of normalised text per id
  std::array<int32_t, 256> byte_ids{};
  BpeMerges merges;
  std::vector<AddedToken> added_tokens;
  StringIdMap added_by_content;
  AddedTokenMatcher raw_added;         // normalized: false
  AddedTokenMatcher normalized_added;  // normalized: true
};

namespace {

using nlohmann::json;

std::atomic<uint64_t> next_instance_id{1};

// Piece -> ids, per thread and tokenizer; cleared when it grows past kCacheMaxEntries.
constexpr size_t kCacheMaxEntries = 1 << 17;
constexpr size_t kCacheMaxPieceBytes = 128;
struct PieceCache {
  uint64_t owner = 0;
  std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> entries;
};

std::string read_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  CHECK(file.good(), "cannot open tokenizer file '", path, "'");
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

std::string type_of(const json& node) {
  return node.is_object() && node.contains("type") && node["type"].is_string() ? node["type"].get<std::string>() : "";
}

void load_normalizer(const json& node, TokenizerData& data, const std::string& source) {
  if (node.is_null()) return;
  const std::string type = type_of(node);
  if (type == "NFC") {
    data.nfc = true;
    return;
  }
  if (type == "Sequence" && node.contains("normalizers")) {
    for (const json& child : node["normalizers"]) load_normalizer(child, data, source);
    return;
  }
  RAISE(source, ": normalizer '", node.dump(), "' is not supported (deltamoe handles NFC or none)");
}

void check_byte_level(const json& node, const std::string& source, const char* where) {
  CHECK(type_of(node) == "ByteLevel", source, ": ", where, " must be ByteLevel, found ", node.dump());
  CHECK(!node.value("add_prefix_space", false), source, ": ", where, " ByteLevel with add_prefix_space is not supported");
}

void load_pre_tokenizer(const json& node, TokenizerData& data, const std::string& source) {
  const std::string unsupported = str_cat(source, ": pre_tokenizer '", node.dump().substr(0, 300),
                                          "' is not supported (expected Sequence[Split(Regex), ByteLevel(use_regex=false)])");
  CHECK(type_of(node) == "Sequence" && node.contains("pretokenizers") && node["pretokenizers"].size() == 2, unsupported);
  const json& split = node["pretokenizers"][0];
  const json& byte_level = node["pretokenizers"][1];
  CHECK(type_of(split) == "Split" && split.contains("pattern") && split["pattern"].contains("Regex") &&
            split.value("behavior", "") == "Isolated" && !split.value("invert", false),
        unsupported);
  check_byte_level(byte_level, source, "pre_tokenizer[1]");
  CHECK(!byte_level.value("use_regex", true), unsupported);
  const std::string regex = split["pattern"]["Regex"].get<std::string>();
  const std::optional<SplitPattern> pattern = split_pattern_from_regex(regex);
  CHECK(pattern.has_value(), source, ": unsupported Split pre-tokenizer regex '", regex,
        "': deltamoe implements the Qwen2/Qwen3 and Qwen3.5 patterns only");
  data.split_pattern = *pattern;
}

// encode() adds nothing around the text, so a post-processor may only leave it as it is: none,
// ByteLevel (offsets only), or a template of the text alone.
void check_post_processor(const json& node, const std::string& source) {
  const std::string type = type_of(node);
  if (node.is_null() || type == "ByteLevel") return;
  if (type == "TemplateProcessing" && node.contains("single") && node["single"].is_array() && node["single"].size() == 1 &&
      node["single"][0].contains("Sequence")) {
    return;
  }
  RAISE(source, ": post_processor ", node.dump().substr(0, 300),
        " adds tokens around the text, which deltamoe does not do; Qwen tokenizers have none");
}

// merges: ["a b", ...] (older files) or [["a", "b"], ...].
std::pair<std::string, std::string> merge_parts(const json& merge, size_t rank, const std::string& source) {
  if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
    return {merge[0].get<std::string>(), merge[1].get<std::string>()};
  }
  if (merge.is_string()) {
    const std::string text = merge.get<std::string>();
    const size_t space = text.find(' ');
    if (space != std::string::npos && space > 0 && text.find(' ', space + 1) == std::string::npos) {
      return {text.substr(0, space), text.substr(space + 1)};
    }
  }
  RAISE(source, ": model.merges[", rank, "] = ", merge.dump(), " is not a pair of tokens");
}

void load_model(const json& model, TokenizerData& data, const std::string& source) {
  CHECK(type_of(model) == "BPE", source, ": model type '", type_of(model), "' is not supported (byte-level BPE only)");
  CHECK(model.value("dropout", json()).is_null(), source, ": BPE dropout is not supported");
  CHECK(!model.value("byte_fallback", false), source, ": BPE byte_fallback is not supported");
  for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json value = model.value(affix, json());
    CHECK(value.is_null() || value == "", source, ": BPE ", affix, " is not supported");
  }
  data.ignore_merges = model.value("ignore_merges", false);
  CHECK(model.contains("vocab") && model["vocab"].is_object(), source, ": model.vocab is missing");
  for (const auto& [token, id] : model["vocab"].items()) {
    CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < (1 << 30), source,
          ": model.vocab['", token, "'] has a bad id ", id.dump());
    data.vocab.emplace(token, id.get<int32_t>());
    const size_t index = static_cast<size_t>(id.get<int32_t>());
    if (data.id_to_token.size() <= index) data.id_to_token.resize(index + 1);
    data.id_to_token[index] = token;
  }
  for (int byte = 0; byte < 256; ++byte) {
    const auto it = data.vocab.find(byte_level_char(static_cast<uint8_t>(byte)));
    CHECK(it != data.vocab.end(), source, ": the vocabulary lacks the byte-level token for byte ", byte);
    data.byte_ids[byte] = it->second;
  }
  CHECK(model.contains("merges") && model["merges"].is_array(), source, ": model.merges is missing");
  const json& merges = model["merges"];
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto [left, right] = merge_parts(merges[rank], rank, source);
    const auto left_id = data.vocab.find(left), right_id = data.vocab.find(right), merged = data.vocab.find(left + right);
    CHECK(left_id != data.vocab.end() && right_id != data.vocab.end() && merged != data.vocab.end(), source,
          ": model.merges[", rank, "] ('", left, "', '", right, "') uses a token missing from the vocabulary");
    data.merges.add(left_id->second, right_id->second, merged->second, static_cast<int32_t>(rank));
  }
  data.merges.finish();
}

void load_added_tokens(const json& list, TokenizerData& data, const std::string& source) {
  if (list.is_null()) return;
  CHECK(list.is_array(), source, ": added_tokens is not a list");
  for (const json& entry : list) {
    AddedToken token;
    token.content = entry.value("content", "");
    token.id = entry.value("id", -1);
    token.special = entry.value("special", false);
    token.normalized = entry.value("normalized", !token.special);
    CHECK(!token.content.empty() && token.id >= 0, source, ": bad added token ", entry.dump());
    for (const char* option : {"single_word", "lstrip", "rstrip"}) {
      CHECK(!entry.value(option, false), source, ": added token '", token.content, "' uses ", option,
            ", which deltamoe does not support");
    }
    (token.normalized ? data.normalized_added : data.raw_added).add(token.content, token.id);
    data.added_by_content[token.content] = token.id;
    const size_t index = static_cast<size_t>(token.id);
    if (data.id_to_token.size() <= index) data.id_to_token.resize(index + 1);
    data.id_to_token[index] = token.content;
    data.added_tokens.push_back(std::move(token));
  }
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& path) {
  std::string file = path;
  if (std::filesystem::is_directory(path)) file = (std::filesystem::path(path) / "tokenizer.json").string();
  CHECK(std::filesystem::is_regular_file(file), "tokenizer '", file,
        "' does not exist; pass a tokenizer.json or a model directory that holds one");
  return from_json(read_file(file), file);
}

Tokenizer Tokenizer::from_json(std::string_view json_text, const std::string& source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& error) {
    RAISE(source, ": not valid JSON: ", error.what());
  }
  CHECK(root.is_object() && root.contains("model"), source, ": not a tokenizer.json (no 'model')");
  auto data = std::make_shared<TokenizerData>();
  data->instance_id = next_instance_id.fetch_add(1);
  load_normalizer(root.value("normalizer", json()), *data, source);
  load_pre_tokenizer(root.value("pre_tokenizer", json()), *data, source);
  check_post_processor(root.value("post_processor", json()), source);
  const json decoder = root.value("decoder", json());
  if (!decoder.is_null()) check_byte_level(decoder, source, "decoder");
  load_model(root["model"], *data, source);
  load_added_tokens(root.value("added_tokens", json()), *data, source);

  data->id_to_bytes.resize(data->id_to_token.size());
  data->special.assign(data->id_to_token.size(), false);
  for (size_t id = 0; id < data->id_to_token.size(); ++id) {
    data->id_to_bytes[id] = byte_level_decode_token(data->id_to_token[id]);
  }
  data->text_size.resize(data->id_to_token.size());
  for (size_t id = 0; id < data->id_to_bytes.size(); ++id) data->text_size[id] = static_cast<uint32_t>(data->id_to_bytes[id].size());
  for (const AddedToken& token : data->added_tokens) {
    data->special[token.id] = token.special;
    data->text_size[token.id] = static_cast<uint32_t>(token.content.size());
  }
  return Tokenizer(std::move(data));
}

void Tokenizer::encode_segment(std::string_view normalized, std::vector<int32_t>& ids) const {
  const TokenizerData& data = *data_;
  thread_local PieceCache cache;
  if (cache.owner != data.instance_id) {
    cache.entries.clear();
    cache.owner = data.instance_id;
  }
  thread_local std::vector<std::string_view> pieces;
  pieces.clear();
  split_pieces(normalized, data.split_pattern, pieces);
  for (std::string_view piece : pieces) {
    if (piece.size() == 1) {
      ids.push_back(data.byte_ids[static_cast<unsigned char>(piece[0])]);
      continue;
    }
    if (piece.size() <= kCacheMaxPieceBytes) {
      const auto hit = cache.entries.find(piece);
      if (hit != cache.entries.end()) {
        ids.insert(ids.end(), hit->second.begin(), hit->second.end());
        continue;
      }
    }
    const size_t first = ids.size();
    if (data.ignore_merges) {
      // NOTE: the vocabulary is keyed by byte-level text, so the piece must be mapped first.
      std::string text;
      for (char byte : piece) text += byte_level_char(static_cast<uint8_t>(byte));
      if (const auto it = data.vocab.find(text); it != data.vocab.end()) {
        ids.push_back(it->second);
      } else {
        bpe_merge_piece(piece, data.byte_ids, data.merges, ids);
      }
    } else {
      bpe_merge_piece(piece, data.byte_ids, data.merges, ids);
    }
    if (piece.size() <= kCacheMaxPieceBytes) {
      if (cache.entries.size() >= kCacheMaxEntries) cache.entries.clear();
      cache.entries.emplace(std::string(piece), std::vector<int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(first), ids.end()));
    }
  }
}

void Tokenizer::encode_normalized(std::string_view raw_segment, std::vector<int32_t>& ids) const {
  const TokenizerData& data = *data_;
  const std::string normalized_storage = data.nfc ? nfc_normalize(raw_segment) : std::string();
  const std::string_view normalized = data.nfc ? std::string_view(normalized_storage) : raw_segment;
  size_t pos = 0;
  while (pos < normalized.size()) {
    const AddedTokenMatcher::Match match = data.normalized_added.find(normalized, pos);
    const size_t end = match.begin == std::string_view::npos ? normalized.size() : match.begin;
    if (end > pos) encode_segment(normalized.substr(pos, end - pos), ids);
    if (match.begin == std::string_view::npos) break;
    ids.push_back(match.id);
    pos = match.end;
  }
}

void Tokenizer::encode_append(std::string_view text, std::vector<int32_t>& ids) const {
  const size_t bad = utf8_error_offset(text);
  CHECK(bad == std::string_view::npos, "cannot tokenize text with ill-formed UTF-8 at byte ", bad);
  const TokenizerData& data = *data_;
  size_t pos = 0;
  while (pos < text.size()) {
    const AddedTokenMatcher::Match match = data.raw_added.find(text, pos);
    const size_t end = match.begin == std::string_view::npos ? text.size() : match.begin;
    if (end > pos) encode_normalized(text.substr(pos, end - pos), ids);
    if (match.begin == std::string_view::npos) break;
    ids.push_back(match.id);
    pos = match.end;
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  encode_append(text, ids);
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const TokenizerData& data = *data_;
  std::string bytes;
  for (const int32_t id : ids) {
    CHECK(id >= 0 && static_cast<size_t>(id) < data.id_to_bytes.size() && !data.id_to_token[id].empty(),
          "cannot decode unknown token id ", id, " (vocabulary size ", data.id_to_token.size(), ")");
    if (skip_special_tokens && data.special[id]) continue;
    bytes += data.id_to_bytes[id];
  }
  return utf8_lossy(bytes);
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const auto it = data_->added_by_content.find(token); it != data_->added_by_content.end()) return it->second;
  if (const auto it = data_->vocab.find(token); it != data_->vocab.end()) return it->second;
  return std::nullopt;
}

int32_t Tokenizer::require_token_id(std::string_view token) const {
  const std::optional<int32_t> id = token_to_id(token);
  CHECK(id.has_value(), "the tokenizer has no token '", token, "'");
  return *id;
}

const std::string& Tokenizer::id_to_token(int32_t id) const {
  CHECK(id >= 0 && static_cast<size_t>(id) < data_->id_to_token.size() && !data_->id_to_token[id].empty(),
        "unknown token id ", id);
  return data_->id_to_token[id];
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(data_->id_to_token.size()); }

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < data_->special.size() && data_->special[id];
}

size_t Tokenizer::token_text_size(int32_t id) const {
  CHECK(id >= 0 && static_cast<size_t>(id) < data_->text_size.size(), "unknown token id ", id);
  return data_->text_size[id];
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const { return data_->added_tokens; }

}  // namespace deltamoe
