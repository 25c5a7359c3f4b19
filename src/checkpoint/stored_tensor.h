// StoredTensor: the bytes of one checkpoint tensor without necessarily holding them in RAM —
// a list of byte ranges inside mmapped safetensors files or owned host buffers, or a producer
// that computes the bytes when they are needed (random init, trainer weights at save time).
// This is what keeps a 70 GB checkpoint from needing 70 GB of RAM: loads map, saves stream.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace deltamoe {

class StoredTensor {
 public:
  // One contiguous byte range; `owner` keeps the mapping or buffer alive.
  struct Chunk {
    const uint8_t* data = nullptr;
    size_t nbytes = 0;
    std::shared_ptr<const void> owner;
    // Bytes of a read-only file mapping: after they are copied out, their pages are handed back to
    // the OS (they are re-read from the file if touched again), so streaming a 70 GB checkpoint
    // does not grow the resident set by 70 GB.
    bool file_mapped = false;
  };
  // Fills dst (nbytes() bytes) with the tensor's bytes.
  using Producer = std::function<void(void* dst)>;
  // Fills dst with the tensor's bytes [byte_offset, byte_offset + nbytes) (ranges are whole elements).
  using RangeProducer = std::function<void(void* dst, size_t byte_offset, size_t nbytes)>;

  StoredTensor() = default;
  // Takes shared ownership of a host tensor (no copy).
  static StoredTensor from_host(const HostTensor& tensor);
  // Bytes that live elsewhere (e.g. an mmapped file), kept alive by `owner`.
  static StoredTensor from_bytes(DType dtype, Shape shape, const void* data, std::shared_ptr<const void> owner);
  // The same for bytes inside a read-only file mapping (see Chunk::file_mapped).
  static StoredTensor from_mapped_file(DType dtype, Shape shape, const void* data, std::shared_ptr<const void> owner);
  // Bytes computed on demand by `produce` (called once per read; must be deterministic).
  static StoredTensor from_producer(DType dtype, Shape shape, Producer produce);
  // Bytes computed on demand, any range at a time: streamed writes then need only one piece of
  // memory, however large the tensor (random init of 8 GB expert tensors).
  static StoredTensor from_range_producer(DType dtype, Shape shape, RangeProducer produce);
  // Concatenation of `parts` along axis 0 (all of `dtype`, row sizes must add up to `shape`).
  // No bytes are copied for chunked parts; this is how per-expert tensors become fused ones.
  static StoredTensor concat(DType dtype, Shape shape, const std::vector<StoredTensor>& parts);

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  // True for a default-constructed StoredTensor.
  bool empty() const { return chunks_.empty() && !producer_ && !range_producer_ && shape_.rank() == 0; }
  bool is_producer() const { return producer_ || range_producer_; }

  // The byte range [offset, offset + shape.numel()*dtype size) viewed as a tensor of `shape`.
  // No copy for chunked tensors or range producers; a whole-tensor producer is run once first.
  StoredTensor slice_bytes(size_t offset, Shape shape) const;
  // Copies all bytes to dst (nbytes() bytes).
  void read_into(void* dst) const;
  // Calls sink(piece, n) over the bytes in order, at most `max_piece` bytes at a time
  // (for streamed writes; a whole-tensor producer is materialised in one buffer first, a range
  // producer fills one piece-sized buffer at a time).
  void for_each_piece(const std::function<void(const uint8_t*, size_t)>& sink, size_t max_piece = 64u << 20) const;
  // An owned copy (same dtype); to_host().to_f32() for master weights.
  HostTensor to_host() const;
  // Bitwise equality of dtype, shape and bytes.
  bool bitwise_equal(const StoredTensor& other) const;

 private:
  DType dtype_ = DType::f32;
  Shape shape_;
  std::vector<Chunk> chunks_;
  Producer producer_;
  RangeProducer range_producer_;
  size_t range_offset_ = 0;  // where this tensor starts inside range_producer_'s bytes (slices)
};

}  // namespace deltamoe
