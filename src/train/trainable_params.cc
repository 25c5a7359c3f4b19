// Trainable-parameter selection and the checkpoint view of a training state's master weights.
#include "train/trainable_params.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "optim/split_master.h"

namespace deltamoe {

namespace {

// Masters into a 16-bit on-disk dtype. bf16 as the engines' working weights are rounded: the
// master's high half, ties away from zero (optim/split_master.h), so a saved model computes with
// the weights training computed with; NaN stays NaN (its high half could carry into -0). fp16 to
// nearest even.
void write_rounded(const float* master, DType disk_dtype, uint8_t* target, int64_t count) {
  if (disk_dtype != DType::bf16) {
    convert_floats(master, DType::f32, target, disk_dtype, count);
    return;
  }
  for (int64_t i = 0; i < count; ++i) {
    uint16_t high, low;
    if (std::isnan(master[i])) {
      convert_floats(master + i, DType::f32, &high, DType::bf16, 1);
    } else {
      split_master(master[i], high, low);
    }
    std::memcpy(target + 2 * i, &high, 2);
  }
}

}  // namespace

ParamGroup param_group(const std::string& name) {
  if (name.starts_with("model.visual.merger.")) return ParamGroup::aligner;
  if (name.starts_with("model.visual.")) return ParamGroup::vit;
  return ParamGroup::llm;
}

bool is_frozen(const std::string& name, const FreezeOptions& freeze) {
  switch (param_group(name)) {
    case ParamGroup::vit: return freeze.freeze_vit;
    case ParamGroup::aligner: return freeze.freeze_aligner;
    case ParamGroup::llm: return freeze.freeze_llm;
  }
  return true;
}

ParamLayout trainable_layout(const ModelCheckpoint& checkpoint, const FreezeOptions& freeze) {
  ParamLayout layout;
  for (const auto& [name, tensor] : checkpoint.params) {
    if (!is_frozen(name, freeze)) layout.add(name, tensor.shape().to_vector());
  }
  CHECK(layout.num_tensors() > 0, "train: every parameter is frozen (--freeze_llm, --freeze_vit, ",
        "--freeze_aligner); nothing would be trained");
  return layout;
}

ParamLayout lora_layout(const ModelCheckpoint& checkpoint, const LoraAdapters& lora) {
  ParamLayout layout;
  for (const std::string& name : lora.trained_names()) {
    if (auto adapter = lora.tensors.find(name); adapter != lora.tensors.end()) {
      layout.add(name, adapter->second.shape().to_vector());
      continue;
    }
    auto it = checkpoint.params.find(name);
    CHECK(it != checkpoint.params.end(), "LoRA: --modules_to_save names '", name, "', which the checkpoint lacks");
    layout.add(name, it->second.shape().to_vector());
  }
  CHECK(layout.num_tensors() > 0, "LoRA: no adapter to train");
  return layout;
}

LoraAdapters lora_adapters_from_state(const LoraAdapters& lora, const TrainStateStore& state) {
  LoraAdapters current = lora;
  const ParamLayout& layout = state.layout();
  for (int index = 0; index < layout.num_tensors(); ++index) {
    const ParamEntry& entry = layout.entry(index);
    CHECK(entry.is_whole_tensor(), "save: '", entry.name, "' is held in part by this engine; an adapter save needs ",
          "every trained tensor whole");
    HostTensor values(DType::f32, Shape(entry.shape));
    state.read_state(StateKind::master, index, 0, entry.numel, values.data());
    current.tensors[entry.name] = std::move(values);
  }
  return current;
}

ModelCheckpoint checkpoint_with_state(const ModelCheckpoint& base, const TrainStateStore& state) {
  ModelCheckpoint out = base;
  const ParamLayout& layout = state.layout();
  // The state entries (pieces) of each trained tensor, in element order.
  std::map<std::string, std::vector<int>> pieces;
  for (int index = 0; index < layout.num_tensors(); ++index) pieces[layout.entry(index).name].push_back(index);
  for (auto& [name, indices] : pieces) {
    std::sort(indices.begin(), indices.end(), [&](int a, int b) {
      return layout.entry(a).tensor_begin < layout.entry(b).tensor_begin;
    });
    auto it = out.params.find(name);
    CHECK(it != out.params.end(), "train: the checkpoint has no tensor '", name, "' to save into");
    const DType disk_dtype = it->second.dtype();
    CHECK(disk_dtype == DType::f32 || disk_dtype == DType::bf16 || disk_dtype == DType::f16, "save: '", name,
          "' is stored as ", dtype_name(disk_dtype), ", which a trained tensor cannot be written as");
    const size_t element = dtype_size(disk_dtype);
    it->second = StoredTensor::from_range_producer(
        disk_dtype, it->second.shape(),
        [&state, &layout, indices, disk_dtype, element, name](void* dst, size_t offset, size_t nbytes) {
          int64_t first = static_cast<int64_t>(offset / element);
          const int64_t end = first + static_cast<int64_t>(nbytes / element);
          auto* out_bytes = static_cast<uint8_t*>(dst);
          std::vector<float> master;
          for (const int index : indices) {
            const ParamEntry& piece = layout.entry(index);
            if (first >= end) break;
            if (piece.tensor_begin + piece.numel <= first || piece.tensor_begin > first) continue;
            const int64_t count = std::min(end, piece.tensor_begin + piece.numel) - first;
            uint8_t* target = out_bytes + static_cast<size_t>(first) * element - offset;
            if (disk_dtype == DType::f32) {
              state.read_state(StateKind::master, index, first - piece.tensor_begin, count, target);
            } else {
              master.resize(static_cast<size_t>(count));
              state.read_state(StateKind::master, index, first - piece.tensor_begin, count, master.data());
              write_rounded(master.data(), disk_dtype, target, count);
            }
            first += count;
          }
          CHECK(first >= end, "save: elements [", first, ", ", end, ") of '", name,
                "' are not held by this rank's training state");
        });
  }
  return out;
}

}  // namespace deltamoe
