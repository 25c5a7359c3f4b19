// A Hugging Face model directory (config.json + safetensors) as the model sees it: parameters in
// the fused in-memory layout under their HF names, plus the tensors the model does not use
// (mtp.*) carried through unchanged. Both on-disk expert layouts load; a save keeps the layout.
//
// RAM rule: tensors are StoredTensors, i.e. views of the mmapped files (per-expert tensors become
// a fused tensor by listing the per-expert byte ranges, no copy). The trainer materialises one
// tensor at a time (to_host().to_f32() for master weights) and hands weights back for a save as
// StoredTensor::from_host / from_producer, which the writer streams tensor by tensor.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "checkpoint/stored_tensor.h"
#include "model/config.h"
#include "model/param_table.h"

namespace deltamoe {

enum class ExpertLayout {
  fused,       // mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I] (official release)
  per_expert,  // mlp.experts.{e}.gate_proj/up_proj.weight [I, H], down_proj.weight [H, I] (HF 5.17 save)
};
const char* expert_layout_name(ExpertLayout layout);
// "fused" / "per_expert"; throws naming `where` otherwise.
ExpertLayout parse_expert_layout(const std::string& text, const std::string& where);

struct ModelCheckpoint {
  ModelConfig config;
  std::map<std::string, StoredTensor> params;       // fused layout, HF names, on-disk dtype kept
  std::map<std::string, StoredTensor> passthrough;  // mtp.* etc., written back unchanged
  ExpertLayout expert_layout = ExpertLayout::fused;
  // A text-only config (qwen3_5_moe_text) whose files use the VLM prefix model.language_model.*
  // (transformers' text class accepts both). params use model.*; a save restores the file prefix.
  // model.visual.* tensors of such a checkpoint are passthrough.
  bool text_keys_under_language_model = false;
};

// What a checkpoint directory lacks or has too much of, by tensor name.
struct CheckpointReport {
  std::vector<std::string> missing;      // in the parameter table, not in the files
  std::vector<std::string> unexpected;   // in the files, neither a parameter nor passthrough
  std::vector<std::string> wrong_shape;  // "name: has [..], expected [..]"
  std::vector<std::string> wrong_dtype;  // "name: has I64, expected a floating dtype"
  bool ok() const { return missing.empty() && unexpected.empty() && wrong_shape.empty() && wrong_dtype.empty(); }
  // Multi-line text listing every problem by name (empty when ok()).
  std::string describe(const std::string& dir) const;
};

// True for tensors the model does not use but a checkpoint carries (mtp.*).
bool is_passthrough_tensor(const std::string& name);

// Loads dir/config.json and the weights; throws a deltamoe::Error listing missing, unexpected and
// wrong-shape keys by name when the checkpoint does not match its config, and naming the first
// tensor that holds NaN or Inf (check_weights_finite).
ModelCheckpoint load_model_dir(const std::string& dir);
// The same, but key problems are returned in `report` instead of thrown (for deltamoe inspect);
// tensors with problems are left out of the checkpoint.
ModelCheckpoint load_model_dir(const std::string& dir, CheckpointReport* report);

// Reads every floating tensor (parameters and passthrough) once, streaming, and throws naming the
// first that holds NaN or Inf; logs progress every few seconds for checkpoints over 4 GiB.
void check_weights_finite(const ModelCheckpoint& checkpoint, const std::string& dir);

struct SaveOptions {
  std::optional<ExpertLayout> expert_layout;  // default: the checkpoint's own layout
  uint64_t max_shard_bytes = 5'000'000'000;   // 0: always one file
};
// Writes config.json (original text when the config was parsed from a file) and the weights,
// streaming tensor by tensor: parameters in table order, then passthrough tensors by name.
void save_model_dir(const ModelCheckpoint& checkpoint, const std::string& dir, const SaveOptions& options = {});

// What save_model_dir writes, in order: every tensor under its file name, with the parameter (its
// fused in-memory name; "" for a passthrough tensor) and the byte offset inside that parameter its
// bytes come from (per-expert tensors are slices of a fused parameter), and config.json's text.
struct ModelDirContents {
  struct Source {
    std::string param;
    uint64_t byte_offset = 0;
  };
  std::vector<NamedTensor> tensors;
  std::vector<Source> sources;  // one per tensor
  std::string config_text;
};
// `dir` names the destination in messages.
ModelDirContents model_dir_contents(const ModelCheckpoint& checkpoint, const SaveOptions& options,
                                    const std::string& dir);
void write_model_config(const ModelDirContents& contents, const std::string& dir);

// Copies the files of a model directory that are not weights or config.json (tokenizer,
// preprocessor and generation configs, chat template) from src_dir to dst_dir.
void copy_side_files(const std::string& src_dir, const std::string& dst_dir);

}  // namespace deltamoe
