// DeviceParams: flat buffers per kind (bf16 weights, fp32 master, split masters' low halves, fp32
// and bf16 gradients, fp32 frozen copies), uploads through pinned staging, device init, the typed views.
#include "model/gpu/device_params.h"

#include <algorithm>
#include <cstring>

#include "core/cuda_check.h"
#include "core/device_alloc.h"
#include "core/error.h"
#include "core/tensor.h"
#include "model/gpu/param_init.h"
#include "optim/split_master.h"
#include "optim/split_master_cuda.h"

namespace deltamoe {

namespace {

constexpr int64_t kStagingElements = int64_t{16} << 20;  // 64 MiB of fp32 per upload copy

// Pinned host memory, freed with the object.
struct PinnedBuffer {
  explicit PinnedBuffer(size_t bytes) { data = pinned_malloc(std::max<size_t>(bytes, 1), "device params: pinned copy"); }
  ~PinnedBuffer() { cudaFreeHost(data); }
  void* data = nullptr;
};

uint64_t name_stream(const std::string& name) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : name) hash = (hash ^ c) * 0x100000001b3ull;
  return hash;
}

}  // namespace

DeviceParams::DeviceParams(const std::vector<DeviceParamSpec>& specs, bool master_elsewhere,
                           const GradientPlacement* gradients)
    : master_elsewhere_(master_elsewhere) {
  for (const DeviceParamSpec& spec : specs) {
    CHECK(index_.count(spec.name) == 0, "device params: '", spec.name, "' is listed twice");
    Slot slot;
    slot.spec = spec;
    const int w = weights_layout_.add(spec.name, spec.shape);
    slot.numel = weights_layout_.entry(w).numel;
    slot.weight_offset = weights_layout_.entry(w).offset;
    if (spec.full_numel > 0) {
      CHECK(spec.full_first >= 0 && spec.full_first + slot.numel <= spec.full_numel, "device params: '", spec.name,
            "' slice [", spec.full_first, ", ", spec.full_first + slot.numel, ") is outside its ", spec.full_numel,
            " elements");
    } else {
      CHECK(spec.full_first == 0, "device params: '", spec.name, "' has a slice start but no whole size");
    }
    CHECK(!spec.master_split || (spec.trained && !spec.needs_f32), "device params: '", spec.name,
          "' cannot keep its master split: only a trained tensor read in bf16 alone");
    CHECK(!spec.grad_bf16 || (spec.trained && !spec.needs_f32), "device params: '", spec.name,
          "' cannot keep a bf16 gradient: only a trained tensor read in bf16 alone");
    if (spec.trained) {
      slot.trained_index = trained_.add(spec.name, spec.shape);
      // A split master stays here even where the other masters live with the sharded state.
      if (spec.master_split) {
        slot.low_offset = low_layout_.entry(low_layout_.add(spec.name, spec.shape)).offset;
      } else if (!master_elsewhere) {
        slot.master_offset = master_layout_.entry(master_layout_.add(spec.name, spec.shape)).offset;
      }
      if (spec.grad_bf16) {
        slot.grad_bf16_offset = bf16_grads_layout_.entry(bf16_grads_layout_.add(spec.name, spec.shape)).offset;
        CHECK(gradients == nullptr || gradients->offset.count(spec.name) == 0, "device params: '", spec.name,
              "' keeps a bf16 gradient of its own and cannot be placed among the fp32 ones");
      } else if (gradients == nullptr) {
        slot.grad_offset = f32_grads_layout_.entry(f32_grads_layout_.add(spec.name, spec.shape)).offset;
      } else {
        const auto at = gradients->offset.find(spec.name);
        CHECK(at != gradients->offset.end(), "device params: no gradient place for trained '", spec.name, "'");
        CHECK(at->second >= 0 && at->second + slot.numel <= gradients->elements, "device params: the gradient of '",
              spec.name, "' at ", at->second, " overruns the ", gradients->elements, " placed elements");
        slot.grad_offset = at->second;
        const auto aliased = gradients->aliased.find(spec.name);
        slot.grad_aliased = aliased != gradients->aliased.end() && aliased->second;
      }
    }
    if ((!spec.trained || master_elsewhere) && spec.needs_f32) {
      slot.frozen_offset = frozen_layout_.entry(frozen_layout_.add(spec.name, spec.shape)).offset;
    }
    index_[spec.name] = static_cast<int>(slots_.size());
    slots_.push_back(std::move(slot));
  }
  weights_ = DeviceBuffer(static_cast<size_t>(weights_layout_.total_numel()) * 2);
  master_ = DeviceBuffer(static_cast<size_t>(master_layout_.total_numel()) * 4);
  master_low_ = DeviceBuffer(static_cast<size_t>(low_layout_.total_numel()) * 2);
  grads_ = DeviceBuffer(
      static_cast<size_t>(gradients != nullptr ? gradients->elements : f32_grads_layout_.total_numel()) * 4);
  grads_bf16_ = DeviceBuffer(static_cast<size_t>(bf16_grads_layout_.total_numel()) * 2);
  frozen_f32_ = DeviceBuffer(static_cast<size_t>(frozen_layout_.total_numel()) * 4);
  for (DeviceBuffer* buffer : {&weights_, &master_, &master_low_, &grads_, &grads_bf16_, &frozen_f32_})
    CUDA_CHECK(cudaMemset(buffer->data(), 0, buffer->bytes()));
}

const DeviceParams::Slot& DeviceParams::slot(const std::string& name) const {
  const auto it = index_.find(name);
  CHECK(it != index_.end(), "device params: no parameter '", name, "'");
  return slots_[static_cast<size_t>(it->second)];
}

const DeviceParamSpec& DeviceParams::spec(const std::string& name) const { return slot(name).spec; }

DeviceParam DeviceParams::param(const std::string& name, bool needs_f32) const {
  const Slot& s = slot(name);
  DeviceParam p;
  p.w = weights_.as<__nv_bfloat16>() + s.weight_offset;
  p.numel = s.numel;
  if (s.trained_index >= 0) {
    if (s.master_offset >= 0) p.f32 = master_.as<float>() + s.master_offset;
    if (s.grad_bf16_offset >= 0)
      p.grad_bf16 = reinterpret_cast<DeviceBf16*>(grads_bf16_.as<__nv_bfloat16>() + s.grad_bf16_offset);
    else
      p.grad = grads_.as<float>() + s.grad_offset;
  }
  if (s.frozen_offset >= 0) p.f32 = frozen_f32_.as<float>() + s.frozen_offset;
  CHECK(!needs_f32 || p.f32 != nullptr, "device params: '", name, "' is read in fp32 but has no fp32 values ",
        s.low_offset >= 0 ? "(its master is split: list it with needs_f32 and without master_split)"
                          : "(a frozen tensor must be listed with needs_f32)");
  return p;
}

void DeviceParams::upload(const std::string& name, int64_t first, int64_t count, const void* host, DType dtype) {
  const Slot& s = slot(name);
  const int64_t whole = s.spec.full_numel > 0 ? s.spec.full_numel : s.numel;
  CHECK(first >= 0 && count >= 0 && first + count <= whole, "device params: elements [", first, ", ", first + count,
        ") are outside '", name, "' of ", whole);
  const size_t element = dtype_size(dtype);
  // The part that falls in this slice, in the slice's element indices.
  const int64_t lo = std::max(first, s.spec.full_first), hi = std::min(first + count, s.spec.full_first + s.numel);
  if (lo >= hi) return;
  host = static_cast<const uint8_t*>(host) + static_cast<size_t>(lo - first) * element;
  first = lo - s.spec.full_first;
  count = hi - lo;
  static thread_local std::unique_ptr<PinnedBuffer> staging;
  if (!staging) staging = std::make_unique<PinnedBuffer>(static_cast<size_t>(kStagingElements) * 4);
  auto* f32 = static_cast<float*>(staging->data);
  for (int64_t done = 0; done < count; done += kStagingElements) {
    const int64_t n = std::min(kStagingElements, count - done);
    const void* src = static_cast<const uint8_t*>(host) + static_cast<size_t>(done) * element;
    convert_floats(src, dtype, f32, DType::f32, n);
    const int64_t at = first + done;
    __nv_bfloat16* weight = weights_.as<__nv_bfloat16>() + s.weight_offset + at;
    if (s.master_offset >= 0) {
      float* master = master_.as<float>() + s.master_offset + at;
      CUDA_CHECK(cudaMemcpy(master, f32, static_cast<size_t>(n) * 4, cudaMemcpyHostToDevice));
      master_weights_cuda(master, weight, n, nullptr);
    } else if (s.low_offset >= 0) {
      upload_split(f32, n, weight, master_low_.as<uint16_t>() + s.low_offset + at);
    } else {
      if (s.frozen_offset >= 0) {
        CUDA_CHECK(cudaMemcpy(frozen_f32_.as<float>() + s.frozen_offset + at, f32, static_cast<size_t>(n) * 4,
                              cudaMemcpyHostToDevice));
      }
      // bf16 in place in the staging buffer (the first half of it), then up: a trained tensor's
      // (master elsewhere) as its master's high half, as every trained weight is rounded
      // (optim/split_master_cuda.h); a frozen one's to nearest even.
      if (s.trained_index >= 0) {
        auto* halves = reinterpret_cast<uint16_t*>(f32);
        for (int64_t i = 0; i < n; ++i) {
          uint32_t bits;
          std::memcpy(&bits, f32 + i, 4);
          halves[i] = split_master_high(bits);  // writes bytes [2i, 2i + 2), below the floats not yet read
        }
      } else {
        convert_floats(f32, DType::f32, f32, DType::bf16, n);
      }
      CUDA_CHECK(cudaMemcpy(weight, f32, static_cast<size_t>(n) * 2, cudaMemcpyHostToDevice));
    }
  }
  CUDA_CHECK(cudaDeviceSynchronize());
}

void DeviceParams::randomize(uint64_t seed) {
  // fp32 masters and frozen fp32 copies take the values in place; the others go through a
  // temporary (split masters chunk by chunk, then split into their halves).
  int64_t largest_temp = 0;
  for (const Slot& s : slots_) {
    if (s.master_offset >= 0 || s.frozen_offset >= 0) continue;
    largest_temp = std::max(largest_temp, s.low_offset >= 0 ? std::min(s.numel, kStagingElements) : s.numel);
  }
  DeviceBuffer temp(static_cast<size_t>(std::max<int64_t>(largest_temp, 1)) * 4);
  for (const Slot& s : slots_) {
    __nv_bfloat16* weight = weights_.as<__nv_bfloat16>() + s.weight_offset;
    if (s.low_offset >= 0) {
      for (int64_t done = 0; done < s.numel; done += kStagingElements) {
        const int64_t n = std::min(kStagingElements, s.numel - done);
        init_param_cuda(s.spec.init, static_cast<float>(s.spec.init_std), temp.as<float>(), n, seed,
                        name_stream(s.spec.name), nullptr, s.spec.full_first + done);
        split_master_cuda(temp.as<float>(), weight + done, master_low_.as<uint16_t>() + s.low_offset + done, n,
                          nullptr);
      }
      continue;
    }
    float* values = s.master_offset >= 0 ? master_.as<float>() + s.master_offset
                                         : (s.frozen_offset >= 0 ? frozen_f32_.as<float>() + s.frozen_offset
                                                                 : temp.as<float>());
    init_param_cuda(s.spec.init, static_cast<float>(s.spec.init_std), values, s.numel, seed, name_stream(s.spec.name),
                    nullptr, s.spec.full_first);
    if (s.trained_index >= 0) {
      master_weights_cuda(values, weight, s.numel, nullptr);  // how every trained weight is rounded
    } else {
      convert_f32_to_bf16_cuda(values, weight, s.numel, nullptr);
    }
  }
  CUDA_CHECK(cudaDeviceSynchronize());
}

void DeviceParams::init_values(const std::string& name, int64_t first, int64_t count, uint64_t seed, float* out,
                               cudaStream_t stream) const {
  const DeviceParamSpec& spec = slot(name).spec;
  init_param_cuda(spec.init, static_cast<float>(spec.init_std), out, count, seed, name_stream(name), stream, first);
}

std::vector<MasterSpan> DeviceParams::trained_masters() const {
  CHECK(!master_elsewhere_, "device params: the master of these weights is kept by the sharded training state");
  std::vector<MasterSpan> out;
  for (const ParamEntry& e : trained_.entries()) {
    const Slot& s = slot(e.name);
    __nv_bfloat16* weight = weights_.as<__nv_bfloat16>() + s.weight_offset;
    if (s.low_offset >= 0) {
      out.push_back({nullptr, weight, master_low_.as<uint16_t>() + s.low_offset});
    } else {
      out.push_back({master_.as<float>() + s.master_offset, weight, nullptr});
    }
  }
  return out;
}

std::vector<GradientSpan> DeviceParams::trained_gradients() const {
  std::vector<GradientSpan> out;
  for (const ParamEntry& e : trained_.entries()) {
    const Slot& s = slot(e.name);
    CHECK(!s.grad_aliased, "device params: the gradient of '", e.name, "' shares memory with others");
    if (s.grad_bf16_offset >= 0)
      out.push_back({grads_bf16_.as<__nv_bfloat16>() + s.grad_bf16_offset, DType::bf16});
    else
      out.push_back({grads_.as<float>() + s.grad_offset, DType::f32});
  }
  return out;
}

MasterSpan DeviceParams::split_master_span(const std::string& name) const {
  const Slot& s = slot(name);
  CHECK(s.low_offset >= 0, "device params: the master of '", name, "' is not kept split");
  return {nullptr, weights_.as<__nv_bfloat16>() + s.weight_offset, master_low_.as<uint16_t>() + s.low_offset};
}

const DeviceParams::Slot& DeviceParams::trained_slot(int index, int64_t first, int64_t count) const {
  CHECK(index >= 0 && index < trained_.num_tensors(), "device params: no trained piece ", index);
  const ParamEntry& e = trained_.entry(index);
  CHECK(first >= 0 && count >= 0 && first + count <= e.numel, "device params: elements [", first, ", ", first + count,
        ") are outside trained '", e.name, "' of ", e.numel);
  const Slot& s = slot(e.name);
  CHECK(s.master_offset >= 0 || s.low_offset >= 0, "device params: the master of '", e.name,
        "' is kept by the sharded training state");
  return s;
}

void DeviceParams::read_master(int index, int64_t first, int64_t count, float* host) const {
  const Slot& s = trained_slot(index, first, count);
  CUDA_CHECK(cudaDeviceSynchronize());
  if (s.master_offset >= 0) {
    CUDA_CHECK(cudaMemcpy(host, master_.as<float>() + s.master_offset + first, static_cast<size_t>(count) * 4,
                          cudaMemcpyDeviceToHost));
    return;
  }
  // Split: both halves down a chunk at a time, joined on the host.
  const int64_t chunk = std::min(count, kStagingElements);
  std::vector<uint16_t> high(static_cast<size_t>(chunk)), low(static_cast<size_t>(chunk));
  for (int64_t done = 0; done < count; done += chunk) {
    const int64_t n = std::min(chunk, count - done);
    CUDA_CHECK(cudaMemcpy(high.data(), weights_.as<__nv_bfloat16>() + s.weight_offset + first + done,
                          static_cast<size_t>(n) * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(low.data(), master_low_.as<uint16_t>() + s.low_offset + first + done,
                          static_cast<size_t>(n) * 2, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; ++i) host[done + i] = join_split_master_float(high[i], low[i]);
  }
}

void DeviceParams::write_master(int index, int64_t first, int64_t count, const float* host) {
  const Slot& s = trained_slot(index, first, count);
  CUDA_CHECK(cudaDeviceSynchronize());
  if (s.master_offset >= 0) {
    CUDA_CHECK(cudaMemcpy(master_.as<float>() + s.master_offset + first, host, static_cast<size_t>(count) * 4,
                          cudaMemcpyHostToDevice));
  } else {
    upload_split(host, count, weights_.as<__nv_bfloat16>() + s.weight_offset + first,
                 master_low_.as<uint16_t>() + s.low_offset + first);
  }
  // cudaMemcpy from pageable memory may return before the copy lands; callers read on other streams.
  CUDA_CHECK(cudaDeviceSynchronize());
}

void DeviceParams::upload_split(const float* host, int64_t count, __nv_bfloat16* high, uint16_t* low) {
  const int64_t chunk = std::min(count, kStagingElements);
  std::vector<uint16_t> highs(static_cast<size_t>(chunk)), lows(static_cast<size_t>(chunk));
  for (int64_t done = 0; done < count; done += chunk) {
    const int64_t n = std::min(chunk, count - done);
    for (int64_t i = 0; i < n; ++i) split_master(host[done + i], highs[i], lows[i]);
    CUDA_CHECK(cudaMemcpy(high + done, highs.data(), static_cast<size_t>(n) * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(low + done, lows.data(), static_cast<size_t>(n) * 2, cudaMemcpyHostToDevice));
  }
}

void DeviceParams::refresh_trained_weights(cudaStream_t stream) const {
  CHECK(!master_elsewhere_, "device params: the master of these weights is kept by the sharded training state");
  for (const ParamEntry& e : trained_.entries()) {
    const Slot& s = slot(e.name);
    if (s.master_offset < 0) continue;  // split: the weight is the master's high half
    master_weights_cuda(master_.as<float>() + s.master_offset, weights_.as<__nv_bfloat16>() + s.weight_offset,
                        e.numel, stream);
  }
}

void DeviceParams::zero_gradients(cudaStream_t stream, bool leave_written_first) const {
  if (!leave_written_first) {
    CUDA_CHECK(cudaMemsetAsync(grads_.data(), 0, grads_.bytes(), stream));
    CUDA_CHECK(cudaMemsetAsync(grads_bf16_.data(), 0, grads_bf16_.bytes(), stream));
    return;
  }
  CHECK(bf16_grads_layout_.num_tensors() == 0 || bf16_written_first_,
        "device params: the bf16 gradients are left to their first products, but set_written_first did not name them");
  for (const auto& [offset, count] : zeroed_when_leaving_)
    CUDA_CHECK(cudaMemsetAsync(grads_.as<float>() + offset, 0, static_cast<size_t>(count) * sizeof(float), stream));
}

void DeviceParams::set_written_first(const std::vector<std::string>& names, const std::vector<std::string>& norm_reads) {
  std::vector<std::pair<int64_t, int64_t>> left;  // (offset, count) in grads_, sorted below
  std::vector<std::pair<int64_t, int64_t>> read;  // the norm_reads tensors' pieces of `left`
  int bf16_named = 0;
  for (const std::vector<std::string>* list : {&names, &norm_reads}) {
    for (const std::string& name : *list) {
      const Slot& s = slot(name);
      CHECK(s.trained_index >= 0 && !s.grad_aliased, "device params: '", name,
            "' has no gradient of its own to be written first");
      if (s.grad_bf16_offset >= 0) {
        CHECK(list == &names, "device params: '", name, "' has a bf16 gradient, whose sum of squares the norm does "
              "not read apart from the products'");
        ++bf16_named;
        continue;
      }
      left.emplace_back(s.grad_offset, s.numel);
      if (list == &norm_reads) read.emplace_back(s.grad_offset, s.numel);
    }
  }
  // The bf16 gradients have no zeroing pass of their own: all of them are written first, or none
  // (then zero_gradients(.., true) refuses).
  bf16_written_first_ = bf16_named == bf16_grads_layout_.num_tensors();
  CHECK(bf16_named == 0 || bf16_written_first_, "device params: ", bf16_named, " of the ",
        bf16_grads_layout_.num_tensors(), " bf16 gradients are named to be written first: all of them or none");
  std::sort(left.begin(), left.end());
  zeroed_when_leaving_.clear();
  const int64_t total = static_cast<int64_t>(grads_.bytes() / sizeof(float));
  int64_t at = 0;
  for (const auto& [offset, count] : left) {
    CHECK(offset >= at, "device params: written-first gradients overlap");
    if (offset > at) zeroed_when_leaving_.emplace_back(at, offset - at);
    at = offset + count;
  }
  if (total > at) zeroed_when_leaving_.emplace_back(at, total - at);
  std::vector<std::pair<int64_t, int64_t>> summed = zeroed_when_leaving_;
  summed.insert(summed.end(), read.begin(), read.end());
  std::sort(summed.begin(), summed.end());
  std::vector<DeviceF32Span> spans;
  for (const auto& [offset, count] : summed) spans.push_back({grads_.as<float>() + offset, count});
  num_unwritten_spans_ = static_cast<int>(spans.size());
  unwritten_spans_ = DeviceBuffer(std::max<size_t>(1, spans.size()) * sizeof(DeviceF32Span));
  if (!spans.empty()) {
    CUDA_CHECK(cudaMemcpy(unwritten_spans_.data(), spans.data(), spans.size() * sizeof(DeviceF32Span),
                          cudaMemcpyHostToDevice));
    // A pageable copy may still be in flight when cudaMemcpy returns; the norm reads the spans on
    // a non-blocking stream. Setup time: wait for it.
    CUDA_CHECK(cudaDeviceSynchronize());
  }
}

std::vector<float> DeviceParams::read_gradient(const std::string& name) const {
  const Slot& s = slot(name);
  CHECK(s.trained_index >= 0, "device params: '", name, "' is frozen and has no gradient");
  CHECK(!s.grad_aliased, "device params: the gradient of '", name, "' is reduce-scattered during the backward and ",
        "shares its memory; read this rank's reduced piece instead");
  std::vector<float> host(static_cast<size_t>(s.numel));
  CUDA_CHECK(cudaDeviceSynchronize());
  if (s.grad_bf16_offset >= 0) {
    std::vector<uint16_t> bits(host.size());
    CUDA_CHECK(cudaMemcpy(bits.data(), grads_bf16_.as<__nv_bfloat16>() + s.grad_bf16_offset, bits.size() * 2,
                          cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < bits.size(); ++i) host[i] = bf16_bits_to_float(bits[i]);
    return host;
  }
  CUDA_CHECK(cudaMemcpy(host.data(), grads_.as<float>() + s.grad_offset, host.size() * 4, cudaMemcpyDeviceToHost));
  return host;
}

std::vector<float> DeviceParams::read_values(const std::string& name) const {
  const Slot& s = slot(name);
  std::vector<float> host(static_cast<size_t>(s.numel));
  CUDA_CHECK(cudaDeviceSynchronize());
  const float* f32 = param(name, false).f32;
  if (s.low_offset >= 0) {
    read_master(s.trained_index, 0, s.numel, host.data());
  } else if (f32 != nullptr) {
    CUDA_CHECK(cudaMemcpy(host.data(), f32, host.size() * 4, cudaMemcpyDeviceToHost));
  } else {
    std::vector<uint16_t> bits(host.size());
    CUDA_CHECK(cudaMemcpy(bits.data(), weights_.as<__nv_bfloat16>() + s.weight_offset, bits.size() * 2,
                          cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < bits.size(); ++i) host[i] = bf16_bits_to_float(bits[i]);
  }
  return host;
}

DeviceParamBytes DeviceParams::bytes() const {
  return {weights_.bytes(), master_.bytes() + master_low_.bytes(), grads_.bytes() + grads_bf16_.bytes(),
          frozen_f32_.bytes()};
}

}  // namespace deltamoe
