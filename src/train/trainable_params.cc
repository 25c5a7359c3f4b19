// Trainable-parameter selection and the copies between a checkpoint and the flat master buffer.
#include "train/trainable_params.h"

#include <cstring>

#include "core/error.h"
#include "core/log.h"

namespace deltamoe {

ParamGroup param_group(const std::string& name) {
  if (name.starts_with("model.visual.merger.")) return ParamGroup::aligner;
  if (name.starts_with("model.visual.")) return ParamGroup::vit;
  return ParamGroup::llm;
}

namespace {

bool is_frozen(const std::string& name, const FreezeOptions& freeze) {
  switch (param_group(name)) {
    case ParamGroup::vit: return freeze.freeze_vit;
    case ParamGroup::aligner: return freeze.freeze_aligner;
    case ParamGroup::llm: return freeze.freeze_llm;
  }
  return true;
}

}  // namespace

TrainableParams build_trainable_params(const ModelCheckpoint& checkpoint, const FreezeOptions& freeze) {
  TrainableParams result;
  for (const auto& [name, tensor] : checkpoint.params) {
    if (!is_frozen(name, freeze)) result.layout.add(name, tensor.shape().to_vector());
  }
  CHECK(result.layout.num_tensors() > 0, "train: every parameter is frozen (--freeze_llm, --freeze_vit, ",
        "--freeze_aligner); nothing would be trained");
  result.master.assign(static_cast<size_t>(result.layout.total_numel()), 0.0f);
  for (const ParamEntry& entry : result.layout.entries()) {
    const HostTensor values = checkpoint.params.at(entry.name).to_host().to_f32();
    std::memcpy(result.master.data() + entry.offset, values.as<float>(), static_cast<size_t>(entry.numel) * 4);
  }
  return result;
}

ModelCheckpoint checkpoint_with_master(const ModelCheckpoint& base, const ParamLayout& layout, const float* master) {
  ModelCheckpoint out = base;
  for (const ParamEntry& entry : layout.entries()) {
    auto it = out.params.find(entry.name);
    CHECK(it != out.params.end(), "train: the checkpoint has no tensor '", entry.name, "' to save into");
    HostTensor values(DType::f32, Shape(entry.shape));
    std::memcpy(values.data(), master + entry.offset, static_cast<size_t>(entry.numel) * 4);
    const DType disk_dtype = it->second.dtype();
    it->second = StoredTensor::from_host(disk_dtype == DType::f32 ? values : values.to_dtype(disk_dtype));
  }
  return out;
}

}  // namespace deltamoe
