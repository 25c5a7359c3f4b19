// ParamLayout: where each trained piece of a parameter tensor lives inside one flat buffer (master
// weights, gradients and Adam moments all share it), with a weight-decay flag per piece. A piece is
// a whole tensor, or an element range of one (a rank's expert slice or ZeRO shard), so the training
// state is a list of (tensor, element range). FlatRange is a range of the flat buffer.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace deltamoe {

// Elements [tensor_begin, tensor_begin + numel) of parameter tensor `name` (global shape `shape`, in
// row-major order) live at flat elements [offset, offset + numel).
struct ParamEntry {
  std::string name;
  std::vector<int64_t> shape;  // the whole tensor's shape
  int64_t offset = 0;
  int64_t numel = 0;           // elements of this piece
  int64_t tensor_begin = 0;    // first element of the tensor this piece holds
  int64_t tensor_numel() const;
  bool is_whole_tensor() const { return tensor_begin == 0 && numel == tensor_numel(); }
  bool decay = true;  // whether AdamW's decoupled weight decay applies to this tensor
  // Multiplies the scheduled learning rate for this tensor (ms-swift's --vit_lr / --aligner_lr
  // are lr_scale = vit_lr / lr on the vision tensors). Not part of the saved state: a resumed
  // run may change it.
  double lr_scale = 1.0;
};

// A half-open element range [begin, end) of the flat buffer.
struct FlatRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const FlatRange&) const = default;
};

// Tensor offsets are rounded up to this many elements (256 bytes of fp32) so that every tensor
// starts on an address a vectorised CUDA kernel can load directly; the gaps are padding that
// stays zero (zero gradient keeps a zero weight and zero moments zero under AdamW).
constexpr int64_t kFlatAlignmentElements = 64;

class ParamLayout {
 public:
  // Appends a tensor with the default decay rule: tensors of rank >= 2 (matrices, expert stacks,
  // embeddings) decay; 1-D tensors (norm weights, biases, gate vectors) and scalars do not, as
  // Megatron and ms-swift do. Names must be unique and non-empty; returns the entry's index.
  int add(const std::string& name, const std::vector<int64_t>& shape);
  // Appends a tensor with an explicit decay flag.
  int add(const std::string& name, const std::vector<int64_t>& shape, bool decay);
  // Appends elements [begin, end) of tensor `name` (0 <= begin < end <= numel(shape)); pieces of one
  // tensor must not overlap. Decay follows the tensor's shape, as for a whole tensor.
  int add_piece(const std::string& name, const std::vector<int64_t>& shape, int64_t begin, int64_t end);

  // Sets the learning-rate multiplier of tensor index (>= 0).
  void set_lr_scale(int index, double lr_scale);

  const std::vector<ParamEntry>& entries() const { return entries_; }
  int num_tensors() const { return static_cast<int>(entries_.size()); }
  const ParamEntry& entry(int index) const;
  // Index of the (first) piece of the tensor called name, or -1.
  int find(const std::string& name) const;
  // Elements of the flat buffer including alignment padding (the buffer size to allocate).
  int64_t total_numel() const { return total_numel_; }
  FlatRange whole() const { return {0, total_numel_}; }
  // Elements that belong to pieces (without padding).
  int64_t num_parameters() const;

  // The rule used by add(name, shape): rank >= 2 decays.
  static bool default_decay(const std::vector<int64_t>& shape) { return shape.size() >= 2; }

 private:
  int append(ParamEntry entry);

  std::vector<ParamEntry> entries_;
  std::unordered_map<std::string, int> first_piece_;  // name -> index of its first piece
  int64_t total_numel_ = 0;
};

// Splits [0, total_numel) into num_shards contiguous ranges of near-equal size (the first ones
// one element longer when it does not divide), for a ZeRO-style sharded optimizer.
FlatRange shard_range(int64_t total_numel, int shard_idx, int num_shards);

}  // namespace deltamoe
