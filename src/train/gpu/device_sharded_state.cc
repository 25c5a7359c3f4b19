// DeviceTrainState on one rank of a parallel job (device_train_state.h): the pieces' buffers, the
// bucket tables built once, and the step's collectives — the gradient reduce-scatter per dense
// bucket at the step end (in bucket order, after the last micro-batch's backward), the global sum
// of squares, AdamW on the own pieces (one call for the expert pieces, one for the dense pieces),
// and the all-gather per bucket of the updated bf16 weights plus, for the tensors the math reads
// in fp32, of their fp32 values. Every copy and collective is queued on the engine's stream.
#include <algorithm>
#include <cstring>

#include "core/cuda_check.h"
#include "core/error.h"
#include "core/tensor.h"
#include "model/gpu/param_init.h"
#include "optim/grad_norm_cuda.h"
#include "train/gpu/device_train_state.h"

namespace deltamoe {

namespace {

void copy_async(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes > 0) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
}

__nv_bfloat16* weight_of(const DeviceParam& p) { return const_cast<__nv_bfloat16*>(p.w); }

}  // namespace

DeviceTrainState::DeviceTrainState(const std::vector<DeviceParamSpec>& specs, const AdamWConfig& adamw,
                                   cudaStream_t stream, const ParallelLayout& layout, Communicator& world,
                                   Communicator* expert_replicas)
    : params_(std::make_unique<DeviceParams>(specs, /*master_elsewhere=*/true)),
      adamw_(adamw),
      stream_(stream),
      layout_(&layout),
      world_(&world),
      expert_replicas_(expert_replicas) {
  validate_adamw_config(adamw_);
  CHECK(world.size() == layout.world() && world.rank() == layout.rank(), "train state: the layout is rank ",
        layout.rank(), " of ", layout.world(), ", the communicator rank ", world.rank(), " of ", world.size());
  const int64_t total = layout.state().total_numel();
  master_ = DeviceBuffer(static_cast<size_t>(std::max<int64_t>(total, 1)) * 4);
  const size_t moment_bytes = static_cast<size_t>(std::max<int64_t>(total, 1)) * dtype_size(adamw_.moment_dtype);
  exp_avg_ = DeviceBuffer(moment_bytes);
  exp_avg_sq_ = DeviceBuffer(moment_bytes);
  for (DeviceBuffer* buffer : {&master_, &exp_avg_, &exp_avg_sq_}) CUDA_CHECK(cudaMemset(buffer->data(), 0, buffer->bytes()));
  norm_scratch_ = DeviceBuffer(grad_sum_of_squares_workspace_bytes() + 256);
  CUDA_CHECK(cudaMallocHost(&norm_host_, 2 * sizeof(double)));
  setup_sharded();
}

void DeviceTrainState::setup_sharded() {
  const ParamLayout& state = layout_->state();
  const ParamLayout& trained = params_->trained_layout();
  const int num_expert = static_cast<int>(layout_->expert_pieces().size());
  // Expert pieces: the front of the state and of DeviceParams' gradients alike (the engine lists
  // its own expert slices first, in the full layout's order), so AdamW reads their gradients where
  // the backward left them.
  for (int i = 0; i < num_expert; ++i) {
    const ParamEntry& piece = state.entry(i);
    CHECK(i < trained.num_tensors() && trained.entry(i).name == piece.name && trained.entry(i).offset == piece.offset &&
              trained.entry(i).numel == piece.numel,
          "train state: the device tensors do not start with this rank's expert slice '", piece.name, "' (elements [",
          piece.tensor_begin, ", ", piece.tensor_begin + piece.numel, "))");
    const int index = experts_.add_piece(piece.name, piece.shape, piece.tensor_begin, piece.tensor_begin + piece.numel);
    experts_.set_lr_scale(index, piece.lr_scale);
    CHECK(experts_.entry(index).offset == piece.offset && experts_.entry(index).decay == piece.decay,
          "train state: expert piece layout mismatch at '", piece.name, "'");
    expert_weights_.push_back(weight_of(params_->param(piece.name, false)));
    expert_elements_ = piece.offset + piece.numel;
  }
  dense_base_ = num_expert < state.num_tensors() ? state.entry(num_expert).offset : state.total_numel();
  for (int i = num_expert; i < state.num_tensors(); ++i) {
    const ParamEntry& piece = state.entry(i);
    const int index = dense_.add_piece(piece.name, piece.shape, piece.tensor_begin, piece.tensor_begin + piece.numel);
    dense_.set_lr_scale(index, piece.lr_scale);
    CHECK(dense_.entry(index).offset == piece.offset - dense_base_ && dense_.entry(index).decay == piece.decay,
          "train state: dense piece layout mismatch at '", piece.name, "'");
  }
  for (int i = 0; i < state.num_tensors(); ++i) pieces_of_.emplace(state.entry(i).name, i);
  piece_grads_ = DeviceBuffer(static_cast<size_t>(std::max<int64_t>(dense_.total_numel(), 1)) * 4);
  CUDA_CHECK(cudaMemset(piece_grads_.data(), 0, piece_grads_.bytes()));

  // The buckets: every segment of the full gradient / weights with the rank whose piece it is in.
  const int world = layout_->world(), rank = layout_->rank();
  int64_t piece_total = 0, largest = 1;
  std::vector<int64_t> dense_weight_at;  // per dense piece: its position in piece_bf16_
  for (int b = 0; b < layout_->num_buckets(); ++b) {
    Bucket bucket;
    bucket.piece = layout_->piece_elements(b);
    bucket.piece_bf16_at = piece_total;
    piece_total += bucket.piece;
    const auto& own = layout_->own_piece_in_state(b);
    size_t own_index = 0;
    std::vector<int64_t> f32_run(static_cast<size_t>(world), 0);
    for (int r = 0; r < world; ++r) {
      int64_t position = 0;
      for (const ParallelLayout::Segment& segment : layout_->piece_segments(b, r)) {
        const std::string& name = layout_->full().entry(segment.full_entry).name;
        const DeviceParam p = params_->param(name, false);
        CHECK(p.grad != nullptr, "train state: dense tensor '", name, "' of the layout is not trained on the device");
        BucketSegment s;
        s.rank = r;
        s.at = r * bucket.piece + position;
        s.count = segment.count;
        s.grad = p.grad + segment.tensor_begin;
        s.weight = weight_of(p) + segment.tensor_begin;
        if (params_->spec(name).needs_f32) {
          s.f32 = const_cast<float*>(p.f32) + segment.tensor_begin;
          s.f32_at = f32_run[static_cast<size_t>(r)];
          f32_run[static_cast<size_t>(r)] += segment.count;
        }
        if (r == rank) {
          CHECK(own_index < own.size() && own[own_index].second == segment.count,
                "train state: bucket ", b, "'s own piece does not match its segments");
          s.state_offset = own[own_index].first;
          dense_weight_at.push_back(bucket.piece_bf16_at + position);
          ++own_index;
        }
        position += segment.count;
        bucket.elements += segment.count;
        bucket.segments.push_back(s);
      }
    }
    bucket.f32_count = *std::max_element(f32_run.begin(), f32_run.end());
    largest = std::max(largest, bucket.piece * world);
    buckets_.push_back(std::move(bucket));
  }
  CHECK(static_cast<int>(dense_weight_at.size()) == dense_.num_tensors(), "train state: ", dense_weight_at.size(),
        " own bucket segments for ", dense_.num_tensors(), " dense pieces");
  piece_bf16_ = DeviceBuffer(static_cast<size_t>(std::max<int64_t>(piece_total, 1)) * 2);
  CUDA_CHECK(cudaMemset(piece_bf16_.data(), 0, piece_bf16_.bytes()));
  bucket_f32_ = DeviceBuffer(static_cast<size_t>(largest) * 4);
  bucket_bf16_ = DeviceBuffer(static_cast<size_t>(largest) * 2);
  for (const int64_t at : dense_weight_at) dense_weights_.push_back(piece_bf16_.as<__nv_bfloat16>() + at);
}

size_t DeviceTrainState::sharded_step_bytes() const {
  return piece_grads_.bytes() + piece_bf16_.bytes() + bucket_f32_.bytes() + bucket_bf16_.bytes();
}

void DeviceTrainState::upload_master(const std::string& name, int64_t first, int64_t count, const void* host,
                                     DType dtype) {
  CHECK(sharded(), "train state: upload_master is for a rank's pieces");
  const size_t element = dtype_size(dtype);
  std::vector<float> values;
  const auto [begin, end] = pieces_of_.equal_range(name);
  for (auto it = begin; it != end; ++it) {
    const ParamEntry& piece = layout_->state().entry(it->second);
    const int64_t lo = std::max(first, piece.tensor_begin), hi = std::min(first + count, piece.tensor_begin + piece.numel);
    if (lo >= hi) continue;
    values.resize(static_cast<size_t>(hi - lo));
    convert_floats(static_cast<const uint8_t*>(host) + static_cast<size_t>(lo - first) * element, dtype, values.data(),
                   DType::f32, hi - lo);
    CUDA_CHECK(cudaMemcpy(master_.as<float>() + piece.offset + (lo - piece.tensor_begin), values.data(),
                          values.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
}

void DeviceTrainState::randomize_master(uint64_t seed) {
  CHECK(sharded(), "train state: randomize_master is for a rank's pieces");
  for (const ParamEntry& piece : layout_->state().entries())
    params_->init_values(piece.name, piece.tensor_begin, piece.numel, seed, master_.as<float>() + piece.offset, stream_);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void DeviceTrainState::reduce_gradients() {
  if (!sharded()) return;
  const CommStream on{stream_};
  const int world = layout_->world(), rank = layout_->rank();
  float* staging = bucket_f32_.as<float>();
  for (const Bucket& bucket : buckets_) {
    for (const BucketSegment& s : bucket.segments) copy_async(staging + s.at, s.grad, s.count * 4, stream_);
    const int64_t padded = bucket.piece * world;
    if (padded > bucket.elements) {
      CUDA_CHECK(cudaMemsetAsync(staging + bucket.elements, 0, static_cast<size_t>(padded - bucket.elements) * 4, stream_));
    }
    world_->reduce_scatter(staging, staging + rank * bucket.piece, bucket.piece, DType::f32, ReduceOp::sum, on);
    for (const BucketSegment& s : bucket.segments) {
      if (s.rank != rank) continue;
      copy_async(piece_grads_.as<float>() + (s.state_offset - dense_base_), staging + s.at, s.count * 4, stream_);
    }
  }
  if (expert_replicas_ != nullptr && expert_replicas_->size() > 1 && expert_elements_ > 0) {
    expert_replicas_->all_reduce(params_->gradients(), params_->gradients(), expert_elements_, DType::f32,
                                 ReduceOp::sum, on);
  }
}

void DeviceTrainState::start_sharded_sum_of_squares(double divisor) {
  double* result = reinterpret_cast<double*>(norm_scratch_.as<char>() + grad_sum_of_squares_workspace_bytes());
  // [0]: the expert pieces (on the first replica of their block only), [1]: the dense pieces.
  if (layout_->first_expert_replica() && expert_elements_ > 0) {
    grad_sum_of_squares_cuda(params_->gradients(), expert_elements_, divisor, result, norm_scratch_.data(), stream_);
  } else {
    CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(double), stream_));
  }
  if (dense_.total_numel() > 0) {
    grad_sum_of_squares_cuda(piece_grads_.as<float>(), dense_.total_numel(), divisor, result + 1, norm_scratch_.data(),
                             stream_);
  } else {
    CUDA_CHECK(cudaMemsetAsync(result + 1, 0, sizeof(double), stream_));
  }
  world_->all_reduce(result, result, 2, DType::f64, ReduceOp::sum, CommStream{stream_});
  CUDA_CHECK(cudaMemcpyAsync(norm_host_, result, 2 * sizeof(double), cudaMemcpyDeviceToHost, stream_));
}

void DeviceTrainState::sharded_adamw_step(double lr, const GradientScaling& scaling) {
  const int64_t step = adam_step_ + 1;
  const size_t moment = dtype_size(adamw_.moment_dtype);
  if (experts_.num_tensors() > 0) {
    adamw_step_cuda(experts_, adamw_, lr, step, scaling, master_.as<float>(), params_->gradients(), exp_avg_.data(),
                    exp_avg_sq_.data(), expert_weights_, stream_);
  }
  if (dense_.num_tensors() > 0) {
    adamw_step_cuda(dense_, adamw_, lr, step, scaling, master_.as<float>() + dense_base_, piece_grads_.as<float>(),
                    exp_avg_.as<char>() + dense_base_ * static_cast<int64_t>(moment),
                    exp_avg_sq_.as<char>() + dense_base_ * static_cast<int64_t>(moment), dense_weights_, stream_);
  }
  adam_step_ = step;
  gather_weights();
}

void DeviceTrainState::gather_weights() {
  const CommStream on{stream_};
  const int rank = layout_->rank();
  auto* gathered = bucket_bf16_.as<__nv_bfloat16>();
  float* gathered_f32 = bucket_f32_.as<float>();
  for (const Bucket& bucket : buckets_) {
    world_->all_gather(piece_bf16_.as<__nv_bfloat16>() + bucket.piece_bf16_at, gathered, bucket.piece, DType::bf16, on);
    for (const BucketSegment& s : bucket.segments) copy_async(s.weight, gathered + s.at, s.count * 2, stream_);
    if (bucket.f32_count == 0) continue;
    // The fp32 values of the tensors read in fp32: each rank's run of them, packed, in place.
    float* mine = gathered_f32 + rank * bucket.f32_count;
    for (const BucketSegment& s : bucket.segments) {
      if (s.rank == rank && s.f32 != nullptr)
        copy_async(mine + s.f32_at, master_.as<float>() + s.state_offset, s.count * 4, stream_);
    }
    world_->all_gather(mine, gathered_f32, bucket.f32_count, DType::f32, on);
    for (const BucketSegment& s : bucket.segments) {
      if (s.f32 != nullptr)
        copy_async(s.f32, gathered_f32 + s.rank * bucket.f32_count + s.f32_at, s.count * 4, stream_);
    }
  }
}

void DeviceTrainState::restore_sharded_weights() {
  for (int i = 0; i < experts_.num_tensors(); ++i) {
    const ParamEntry& piece = experts_.entry(i);
    convert_f32_to_bf16_cuda(master_.as<float>() + piece.offset, expert_weights_[static_cast<size_t>(i)], piece.numel,
                             stream_);
  }
  for (int i = 0; i < dense_.num_tensors(); ++i) {
    const ParamEntry& piece = dense_.entry(i);
    convert_f32_to_bf16_cuda(master_.as<float>() + dense_base_ + piece.offset, dense_weights_[static_cast<size_t>(i)],
                             piece.numel, stream_);
  }
  gather_weights();
}

}  // namespace deltamoe
