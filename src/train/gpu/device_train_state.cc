// DeviceTrainState: moments beside the parameters, the device optimizer step, and the range copies
// a checkpoint save or resume makes (the sharded step's parts: device_sharded_state.cc).
#include "train/gpu/device_train_state.h"

#include "core/cuda_check.h"
#include "core/device_alloc.h"
#include "core/error.h"
#include "kernels/common/sum_of_squares_cuda.h"

namespace deltamoe {

DeviceTrainState::DeviceTrainState(const std::vector<DeviceParamSpec>& specs, const AdamWConfig& adamw,
                                   cudaStream_t stream)
    : params_(std::make_unique<DeviceParams>(specs)), adamw_(adamw), stream_(stream) {
  validate_adamw_config(adamw_);
  const size_t moment_bytes =
      static_cast<size_t>(params_->trained_layout().total_numel()) * dtype_size(adamw_.moment_dtype);
  exp_avg_ = DeviceBuffer(moment_bytes);
  exp_avg_sq_ = DeviceBuffer(moment_bytes);
  CUDA_CHECK(cudaMemset(exp_avg_.data(), 0, exp_avg_.bytes()));
  CUDA_CHECK(cudaMemset(exp_avg_sq_.data(), 0, exp_avg_sq_.bytes()));
  norm_scratch_ = DeviceBuffer(kSumOfSquaresWorkspaceBytes + 256);
  norm_host_ = static_cast<double*>(pinned_malloc(2 * sizeof(double), "train state: gradient norm"));
  grads_of_pieces_ = params_->trained_gradients();
  adamw_plan_ = std::make_unique<AdamWLaunchPlan>(params_->trained_layout(), adamw_.moment_dtype,
                                                  params_->trained_masters(), grads_of_pieces_, exp_avg_.data(),
                                                  exp_avg_sq_.data());
}

size_t DeviceTrainState::master_bytes() const {
  return params_->bytes().master + (sharded() ? master_.bytes() : 0);
}

DeviceTrainState::~DeviceTrainState() {
  if (norm_host_ != nullptr) cudaFreeHost(norm_host_);
}

void DeviceTrainState::start_sum_of_squares(double divisor, const double* expert_sums, int64_t num_expert_sums) {
  CHECK(expert_sums == nullptr || expert_sums_usable(),
        "train state: the expert gradients are summed over their replicas after the backward, so the sums of "
        "squares formed as it wrote them are not theirs");
  if (sharded()) {
    start_sharded_sum_of_squares(divisor, expert_sums, num_expert_sums);
    return;
  }
  double* result = reinterpret_cast<double*>(norm_scratch_.as<char>() + kSumOfSquaresWorkspaceBytes);
  if (expert_sums != nullptr) {
    // Every bf16 gradient is written first (DeviceParams::set_written_first): expert_sums holds them.
    sum_of_squares_cuda(params_->spans_not_written_first(), params_->num_spans_not_written_first(), expert_sums,
                        num_expert_sums, divisor, result, norm_scratch_.data(), stream_);
  } else {
    // The fp32 and the bf16 gradients' sums, then the two added in that order.
    double* parts = result + 1;
    sum_of_squares_cuda(params_->gradients(), params_->num_f32_gradients(), divisor,
                        parts, norm_scratch_.data(), stream_);
    sum_of_squares_cuda(params_->bf16_gradients(), params_->bf16_gradient_layout().total_numel(), divisor,
                        parts + 1, norm_scratch_.data(), stream_);
    sum_of_squares_cuda(nullptr, 0, parts, 2, divisor, result, norm_scratch_.data(), stream_);
  }
  CUDA_CHECK(cudaMemcpyAsync(norm_host_, result, sizeof(double), cudaMemcpyDeviceToHost, stream_));
}

double DeviceTrainState::finish_sum_of_squares() {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return sharded() ? norm_host_[0] + norm_host_[1] : norm_host_[0];
}

void DeviceTrainState::adamw_step(double lr, const GradientScaling& scaling) {
  if (sharded()) {
    sharded_adamw_step(lr, scaling);
    return;
  }
  adamw_plan_->step(adamw_, lr, adam_step_ + 1, scaling, stream_);
  ++adam_step_;
}

void DeviceTrainState::set_adam_step(int64_t adam_step) {
  CHECK(adam_step >= 0, "train state: negative Adam step ", adam_step);
  adam_step_ = adam_step;
}

void* DeviceTrainState::address(StateKind kind, int index, int64_t first, int64_t count) const {
  const ParamEntry& entry = layout().entry(index);
  CHECK(first >= 0 && count >= 0 && first + count <= entry.numel, "train state: elements [", first, ", ",
        first + count, ") are outside piece '", entry.name, "' of ", entry.numel);
  const int64_t element = entry.offset + first;
  switch (kind) {
    case StateKind::master:
      CHECK(sharded() && !split_piece(index), "train state: masters kept by the parameters are read and written ",
            "through them");
      return master_at(element);
    case StateKind::exp_avg:
      return exp_avg_.as<char>() + element * static_cast<int64_t>(dtype_size(adamw_.moment_dtype));
    case StateKind::exp_avg_sq:
      return exp_avg_sq_.as<char>() + element * static_cast<int64_t>(dtype_size(adamw_.moment_dtype));
  }
  RAISE("train state: unknown state kind");
}

void DeviceTrainState::read_state(StateKind kind, int index, int64_t first, int64_t count, void* host) const {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  // One rank's masters (fp32 or split) and a rank's split expert slices: DeviceParams holds them
  // (a rank's expert pieces are its first trained tensors, checked in setup_sharded).
  if (kind == StateKind::master && (!sharded() || split_piece(index))) {
    params_->read_master(index, first, count, static_cast<float*>(host));
    return;
  }
  CUDA_CHECK(cudaMemcpy(host, address(kind, index, first, count),
                        static_cast<size_t>(count) * dtype_size(state_dtype(kind, adamw_)), cudaMemcpyDeviceToHost));
}

void DeviceTrainState::write_state(StateKind kind, int index, int64_t first, int64_t count, const void* host) {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (kind == StateKind::master && (!sharded() || split_piece(index))) {
    params_->write_master(index, first, count, static_cast<const float*>(host));
    return;
  }
  CUDA_CHECK(cudaMemcpy(address(kind, index, first, count), host,
                        static_cast<size_t>(count) * dtype_size(state_dtype(kind, adamw_)), cudaMemcpyHostToDevice));
}

void DeviceTrainState::state_restored() {
  // write_state's copies come from pageable memory: the last may still be landing when cudaMemcpy
  // returns, and this state's stream does not wait for the legacy stream. Restore time: wait here.
  CUDA_CHECK(cudaDeviceSynchronize());
  if (sharded()) {
    restore_sharded_weights();
  } else {
    params_->refresh_trained_weights(stream_);
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::vector<float> DeviceTrainState::read_piece_gradient(int index) const {
  const ParamEntry& entry = layout().entry(index);
  GradientSpan source;
  if (!sharded()) {
    source = grads_of_pieces_.at(static_cast<size_t>(index));
  } else if (index < experts_.num_tensors()) {
    source = expert_grads_.at(static_cast<size_t>(index));
  } else {
    source = {piece_grads_.as<float>() + (entry.offset - dense_base_), DType::f32};
  }
  std::vector<float> host(static_cast<size_t>(entry.numel));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (source.dtype == DType::bf16) {
    std::vector<uint16_t> bits(host.size());
    CUDA_CHECK(cudaMemcpy(bits.data(), source.data, bits.size() * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < bits.size(); ++i) host[i] = bf16_bits_to_float(bits[i]);
  } else {
    CUDA_CHECK(cudaMemcpy(host.data(), source.data, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
  }
  return host;
}

}  // namespace deltamoe
