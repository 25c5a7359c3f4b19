// StoredTensor: chunk lists over mapped or owned bytes, and lazily produced tensors.
#include "checkpoint/stored_tensor.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace deltamoe {
namespace {

size_t byte_size(DType dtype, const Shape& shape) { return static_cast<size_t>(shape.numel()) * dtype_size(dtype); }

// Drops the whole pages inside [data, data + n) of a read-only file mapping from this process.
void release_mapped_pages(const uint8_t* data, size_t n) {
  static const uintptr_t kPage = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kPage - 1) / kPage * kPage;
  uintptr_t end = (reinterpret_cast<uintptr_t>(data) + n) / kPage * kPage;
  // NOTE: only valid on file mappings; on anonymous memory MADV_DONTNEED would zero the bytes.
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

}  // namespace

StoredTensor StoredTensor::from_mapped_file(DType dtype, Shape shape, const void* data,
                                            std::shared_ptr<const void> owner) {
  StoredTensor out = from_bytes(dtype, shape, data, std::move(owner));
  for (Chunk& chunk : out.chunks_) chunk.file_mapped = true;
  return out;
}

StoredTensor StoredTensor::from_host(const HostTensor& tensor) {
  StoredTensor out;
  out.dtype_ = tensor.dtype();
  out.shape_ = tensor.shape();
  // The HostTensor copy shares its buffer, so holding it keeps the bytes alive.
  auto holder = std::make_shared<const HostTensor>(tensor);
  if (tensor.nbytes() > 0) out.chunks_.push_back({static_cast<const uint8_t*>(tensor.data()), tensor.nbytes(), holder});
  return out;
}

StoredTensor StoredTensor::from_bytes(DType dtype, Shape shape, const void* data, std::shared_ptr<const void> owner) {
  StoredTensor out;
  out.dtype_ = dtype;
  out.shape_ = shape;
  size_t nbytes = byte_size(dtype, shape);
  if (nbytes > 0) out.chunks_.push_back({static_cast<const uint8_t*>(data), nbytes, std::move(owner)});
  return out;
}

StoredTensor StoredTensor::from_producer(DType dtype, Shape shape, Producer produce) {
  StoredTensor out;
  out.dtype_ = dtype;
  out.shape_ = shape;
  out.producer_ = std::move(produce);
  return out;
}

StoredTensor StoredTensor::from_range_producer(DType dtype, Shape shape, RangeProducer produce) {
  StoredTensor out;
  out.dtype_ = dtype;
  out.shape_ = shape;
  out.range_producer_ = std::move(produce);
  return out;
}

StoredTensor StoredTensor::concat(DType dtype, Shape shape, const std::vector<StoredTensor>& parts) {
  StoredTensor out;
  out.dtype_ = dtype;
  out.shape_ = shape;
  size_t total = 0;
  for (const StoredTensor& part : parts) {
    CHECK(part.dtype_ == dtype, "concat: part of dtype ", dtype_name(part.dtype_), " into a ", dtype_name(dtype),
          " tensor");
    total += part.nbytes();
  }
  CHECK(total == out.nbytes(), "concat: parts hold ", total, " bytes but shape ", shape.str(), " needs ", out.nbytes());
  for (const StoredTensor& part : parts) {
    if (part.is_producer()) {
      // Producers have no chunks; run once so the concatenation stays a chunk list.
      HostTensor owned = part.to_host();
      StoredTensor materialised = from_host(owned);
      out.chunks_.insert(out.chunks_.end(), materialised.chunks_.begin(), materialised.chunks_.end());
    } else {
      out.chunks_.insert(out.chunks_.end(), part.chunks_.begin(), part.chunks_.end());
    }
  }
  return out;
}

StoredTensor StoredTensor::slice_bytes(size_t offset, Shape shape) const {
  size_t length = byte_size(dtype_, shape);
  CHECK(offset + length <= nbytes(), "slice of ", length, " bytes at ", offset, " exceeds a tensor of ", nbytes(),
        " bytes ", shape_.str());
  if (producer_) return from_host(to_host()).slice_bytes(offset, shape);
  if (range_producer_) {
    StoredTensor out = from_range_producer(dtype_, shape, range_producer_);
    out.range_offset_ = range_offset_ + offset;
    return out;
  }
  StoredTensor out;
  out.dtype_ = dtype_;
  out.shape_ = shape;
  size_t chunk_start = 0;
  for (const Chunk& chunk : chunks_) {
    size_t chunk_end = chunk_start + chunk.nbytes;
    size_t begin = std::max(chunk_start, offset), end = std::min(chunk_end, offset + length);
    if (begin < end) {
      out.chunks_.push_back({chunk.data + (begin - chunk_start), end - begin, chunk.owner, chunk.file_mapped});
    }
    chunk_start = chunk_end;
  }
  return out;
}

void StoredTensor::read_into(void* dst) const {
  if (producer_) {
    producer_(dst);
    return;
  }
  if (range_producer_) {
    if (nbytes() > 0) range_producer_(dst, range_offset_, nbytes());
    return;
  }
  uint8_t* out = static_cast<uint8_t*>(dst);
  for (const Chunk& chunk : chunks_) {
    std::memcpy(out, chunk.data, chunk.nbytes);
    if (chunk.file_mapped) release_mapped_pages(chunk.data, chunk.nbytes);
    out += chunk.nbytes;
  }
}

void StoredTensor::for_each_piece(const std::function<void(const uint8_t*, size_t)>& sink, size_t max_piece) const {
  if (producer_) {
    HostTensor owned = to_host();
    const uint8_t* bytes = static_cast<const uint8_t*>(owned.data());
    for (size_t done = 0; done < owned.nbytes(); done += max_piece) {
      sink(bytes + done, std::min(max_piece, owned.nbytes() - done));
    }
    return;
  }
  if (range_producer_) {
    // Whole elements per piece, so the producer never sees a split element.
    const size_t element = dtype_size(dtype_);
    const size_t piece = std::max(element, max_piece / element * element);
    std::vector<uint8_t> buffer(std::min(piece, nbytes()));
    for (size_t done = 0; done < nbytes(); done += piece) {
      size_t n = std::min(piece, nbytes() - done);
      range_producer_(buffer.data(), range_offset_ + done, n);
      sink(buffer.data(), n);
    }
    return;
  }
  for (const Chunk& chunk : chunks_) {
    for (size_t done = 0; done < chunk.nbytes; done += max_piece) {
      const size_t n = std::min(max_piece, chunk.nbytes - done);
      sink(chunk.data + done, n);
      if (chunk.file_mapped) release_mapped_pages(chunk.data + done, n);
    }
  }
}

HostTensor StoredTensor::to_host() const {
  HostTensor out(dtype_, shape_);
  read_into(out.data());
  return out;
}

bool StoredTensor::bitwise_equal(const StoredTensor& other) const {
  if (dtype_ != other.dtype_ || shape_ != other.shape_) return false;
  HostTensor a = to_host(), b = other.to_host();
  return std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

}  // namespace deltamoe
