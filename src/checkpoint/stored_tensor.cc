// StoredTensor: chunk lists over mapped or owned bytes, and lazily produced tensors.
#include "checkpoint/stored_tensor.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace deltamoe {
namespace {

size_t byte_size(DType dtype, const Shape& shape) { return static_cast<size_t>(shape.numel()) * dtype_size(dtype); }

}  // namespace

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
    if (part.producer_) {
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
  StoredTensor out;
  out.dtype_ = dtype_;
  out.shape_ = shape;
  size_t chunk_start = 0;
  for (const Chunk& chunk : chunks_) {
    size_t chunk_end = chunk_start + chunk.nbytes;
    size_t begin = std::max(chunk_start, offset), end = std::min(chunk_end, offset + length);
    if (begin < end) out.chunks_.push_back({chunk.data + (begin - chunk_start), end - begin, chunk.owner});
    chunk_start = chunk_end;
  }
  return out;
}

void StoredTensor::read_into(void* dst) const {
  if (producer_) {
    producer_(dst);
    return;
  }
  uint8_t* out = static_cast<uint8_t*>(dst);
  for (const Chunk& chunk : chunks_) {
    std::memcpy(out, chunk.data, chunk.nbytes);
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
  for (const Chunk& chunk : chunks_) {
    for (size_t done = 0; done < chunk.nbytes; done += max_piece) {
      sink(chunk.data + done, std::min(max_piece, chunk.nbytes - done));
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
