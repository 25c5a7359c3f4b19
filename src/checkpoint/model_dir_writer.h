// A model directory written by several processes at once, byte-identical to save_model_dir of the
// same weights: every writer computes the same layout from the tensors' names, shapes and dtypes
// alone (which file each tensor goes to, each file's header, each tensor's file offset), one writer
// creates the files (config.json, the index, every safetensors file at its final size holding its
// header), and each writer then pwrite()s the byte ranges it owns and syncs the files it wrote.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/model_checkpoint.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/sharded.h"

namespace deltamoe {

struct ModelDirLayout {
  ModelDirContents contents;
  WeightsDirPlan plan;
  std::vector<SafetensorsLayout> files;  // per plan file
  std::vector<size_t> file_of;           // per tensor of contents: its plan file
  std::vector<uint64_t> file_offset;     // per tensor of contents: the file offset of its first byte

  // Bytes create_model_dir_files writes: config.json, the index and every file's header.
  uint64_t metadata_bytes() const;
};

ModelDirLayout plan_model_dir(const ModelCheckpoint& checkpoint, const SaveOptions& options);

// The one writer's part, before any writer writes a range: config.json, the index, and each
// safetensors file created at its final size (ftruncate: the data region reads as zeros until
// written) with its header, each synced. dir must exist and hold no weights yet.
void create_model_dir_files(const ModelDirLayout& layout, const std::string& dir);

// Bytes [begin, end) of tensor `tensor` of the layout's contents.
struct TensorByteRange {
  size_t tensor = 0;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// Writes each range's bytes (read from the layout's tensors) into its file with pwrite, then syncs
// every file it wrote to. Writers' ranges must not overlap; the files must have been created.
void write_model_dir_ranges(const ModelDirLayout& layout, const std::string& dir,
                            const std::vector<TensorByteRange>& ranges);

}  // namespace deltamoe
