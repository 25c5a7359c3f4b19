// DeviceTrainState on one rank of a parallel job (device_train_state.h): where the gradients live
// (the expert slices first, then one region every dense gradient group shares), the pieces'
// buffers, the bucket tables built once, and the step's collectives — each group's in-place
// reduce-scatter per bucket as the backward finishes its phase, the global sum of squares, AdamW on
// the own pieces (one call for the expert pieces, one for the dense pieces), and the all-gather per
// bucket of the updated bf16 weights plus, for the tensors the math reads in fp32, of their fp32
// values. Every copy and collective is queued on the engine's stream.
#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "core/cuda_check.h"
#include "core/device_alloc.h"
#include "core/error.h"
#include "core/tensor.h"
#include "optim/grad_accumulate_cuda.h"
#include "optim/split_master_cuda.h"
#include "kernels/common/sum_of_squares_cuda.h"
#include "train/gpu/device_train_state.h"
#include "train/sharded_region.h"

namespace deltamoe {

namespace {

void copy_async(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes > 0) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
}

__nv_bfloat16* weight_of(const DeviceParam& p) { return const_cast<__nv_bfloat16*>(p.w); }

int64_t align_up(int64_t elements) {
  return (elements + kFlatAlignmentElements - 1) / kFlatAlignmentElements * kFlatAlignmentElements;
}

// The fp32 gradient buffer of a rank: its trained expert slices where the trained layout puts them
// (the front: AdamW reads them in place) unless they keep bf16 gradients of their own
// (DeviceParamSpec::grad_bf16), then the shared region (sharded_region.h), where every dense
// tensor sits at its position in its group (the reduce-scatter's input order).
GradientPlacement sharded_gradients(const std::vector<DeviceParamSpec>& specs, const ParallelLayout& layout,
                                    const ShardedRegion& region, int64_t* region_begin) {
  ParamLayout trained;
  std::unordered_set<std::string> bf16_grads;  // kept by DeviceParams in a buffer of their own
  for (const DeviceParamSpec& spec : specs) {
    if (spec.trained) trained.add(spec.name, spec.shape);
    if (spec.grad_bf16) bf16_grads.insert(spec.name);
  }
  GradientPlacement placement;
  int64_t experts_end = 0;
  for (const auto& [state_index, full_index] : layout.expert_pieces()) {
    const std::string& name = layout.full().entry(full_index).name;
    const int at = trained.find(name);
    CHECK(at >= 0, "train state: this rank's expert slice '", name, "' is not trained on the device");
    if (bf16_grads.count(name) != 0) continue;
    placement.offset[name] = trained.entry(at).offset;
    experts_end = std::max(experts_end, trained.entry(at).offset + trained.entry(at).numel);
  }
  *region_begin = align_up(experts_end);
  for (const ParamEntry& entry : trained.entries()) {
    if (placement.offset.count(entry.name) != 0 || bf16_grads.count(entry.name) != 0) continue;
    const int full = layout.full().find(entry.name);
    CHECK(full >= 0, "train state: trained tensor '", entry.name, "' is not in the parallel layout");
    const auto [group, position] = layout.group_position(full);
    CHECK(group >= 0, "train state: '", entry.name, "' is in no dense gradient group");
    placement.offset[entry.name] = *region_begin + position;
    placement.aliased[entry.name] = true;
  }
  placement.elements = *region_begin + (region.bytes() + 3) / 4;
  return placement;
}

}  // namespace

DeviceTrainState::DeviceTrainState(const std::vector<DeviceParamSpec>& specs, const AdamWConfig& adamw,
                                   cudaStream_t stream, const ParallelLayout& layout, Communicator& world,
                                   Communicator* expert_replicas, const std::vector<GradientPhase>& phases)
    : adamw_(adamw),
      stream_(stream),
      layout_(&layout),
      world_(&world),
      expert_replicas_(expert_replicas) {
  validate_adamw_config(adamw_);
  CHECK(world.size() == layout.world() && world.rank() == layout.rank(), "train state: the layout is rank ",
        layout.rank(), " of ", layout.world(), ", the communicator rank ", world.rank(), " of ", world.size());
  std::unordered_map<std::string, bool> read_in_f32;
  for (const DeviceParamSpec& spec : specs) read_in_f32[spec.name] = spec.needs_f32;
  region_ = plan_sharded_region(layout, [&](const std::string& name) {
    const auto it = read_in_f32.find(name);
    return it != read_in_f32.end() && it->second;
  });
  int64_t region_begin = 0;
  const GradientPlacement placement = sharded_gradients(specs, layout, region_, &region_begin);
  params_ = std::make_unique<DeviceParams>(specs, /*master_elsewhere=*/true, &placement);
  group_region_ = params_->gradients() + region_begin;
  const int64_t total = layout.state().total_numel();
  // The expert slices keep their masters split in DeviceParams (all of them or none); the fp32
  // masters here start after them.
  int num_split = 0;
  for (const auto& [state_index, full_index] : layout.expert_pieces())
    if (params_->spec(layout.full().entry(full_index).name).master_split) ++num_split;
  CHECK(num_split == 0 || num_split == static_cast<int>(layout.expert_pieces().size()), "train state: ", num_split,
        " of this rank's ", layout.expert_pieces().size(), " expert slices keep their masters split: all or none");
  experts_split_ = num_split > 0;
  master_base_ = experts_split_ ? layout.dense_state_begin() : 0;
  master_ = DeviceBuffer(static_cast<size_t>(std::max<int64_t>(total - master_base_, 1)) * 4);
  const size_t moment_bytes = static_cast<size_t>(std::max<int64_t>(total, 1)) * dtype_size(adamw_.moment_dtype);
  exp_avg_ = DeviceBuffer(moment_bytes);
  exp_avg_sq_ = DeviceBuffer(moment_bytes);
  for (DeviceBuffer* buffer : {&master_, &exp_avg_, &exp_avg_sq_}) CUDA_CHECK(cudaMemset(buffer->data(), 0, buffer->bytes()));
  norm_scratch_ = DeviceBuffer(kSumOfSquaresWorkspaceBytes + 256);
  norm_host_ = static_cast<double*>(pinned_malloc(2 * sizeof(double), "sharded state: gradient norm"));
  setup_sharded(phases);
}

void DeviceTrainState::setup_sharded(const std::vector<GradientPhase>& phases) {
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
    const DeviceParam p = params_->param(piece.name, false);
    expert_weights_.push_back(weight_of(p));
    expert_grads_.push_back(p.grad_bf16 != nullptr ? GradientSpan{p.grad_bf16, DType::bf16}
                                                   : GradientSpan{p.grad, DType::f32});
    expert_elements_ = piece.offset + piece.numel;
  }
  // The expert slices' gradients are bf16 all together or fp32 all together (one all-reduce over
  // their replicas, one norm pass), and then they are the only bf16 gradients, laid out as the
  // state's front.
  int num_bf16 = 0;
  for (const GradientSpan& g : expert_grads_) num_bf16 += g.dtype == DType::bf16;
  CHECK(num_bf16 == 0 || num_bf16 == num_expert, "train state: ", num_bf16, " of this rank's ", num_expert,
        " expert slices keep bf16 gradients: all or none");
  experts_bf16_grad_ = num_bf16 > 0;
  CHECK(params_->bf16_gradient_layout().num_tensors() == num_bf16 &&
            (!experts_bf16_grad_ || params_->bf16_gradient_layout().total_numel() == expert_elements_),
        "train state: the bf16 gradients are not exactly this rank's expert slices");
  dense_base_ = num_expert < state.num_tensors() ? state.entry(num_expert).offset : state.total_numel();
  CHECK(!experts_split_ || dense_base_ == master_base_, "train state: the dense pieces start at ", dense_base_,
        ", the layout says ", master_base_);
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

  // The buckets: every segment of the full weights with the rank whose piece it is in.
  const int world = layout_->world(), rank = layout_->rank();
  int64_t piece_total = 0;
  std::vector<int64_t> dense_weight_at;  // per dense piece: its position in piece_bf16_
  for (int b = 0; b < layout_->num_buckets(); ++b) {
    Bucket bucket;
    bucket.piece = layout_->piece_elements(b);
    bucket.grad = group_region_ + layout_->bucket_offset_in_group(b);
    bucket.piece_bf16_at = piece_total;
    piece_total += bucket.piece;
    const auto& own = layout_->own_piece_in_state(b);
    size_t own_index = 0;
    std::vector<int64_t> f32_run(static_cast<size_t>(world), 0);
    for (int r = 0; r < world; ++r) {
      for (const ParallelLayout::Segment& segment : layout_->piece_segments(b, r)) {
        const std::string& name = layout_->full().entry(segment.full_entry).name;
        const DeviceParam p = params_->param(name, false);
        CHECK(p.grad != nullptr, "train state: dense tensor '", name, "' of the layout is not trained on the device");
        BucketSegment s;
        s.rank = r;
        s.at = r * bucket.piece + segment.in_piece;
        s.count = segment.count;
        s.weight = weight_of(p) + segment.tensor_begin;
        if (params_->spec(name).needs_f32) {
          s.f32 = const_cast<float*>(p.f32) + segment.tensor_begin;
          s.f32_at = f32_run[static_cast<size_t>(r)];
          f32_run[static_cast<size_t>(r)] += segment.count;
        }
        if (r == rank) {
          CHECK(own_index < own.size() && own[own_index].count == segment.count &&
                    own[own_index].in_piece == segment.in_piece,
                "train state: bucket ", b, "'s own piece does not match its segments");
          s.state_offset = own[own_index].state_offset;
          dense_weight_at.push_back(bucket.piece_bf16_at + segment.in_piece);
          ++own_index;
        }
        // The reduce-scatter reads the gradient in place: it must be where the layout says.
        CHECK(p.grad + segment.tensor_begin == bucket.grad + s.at, "train state: the gradient of '", name,
              "' is not at its place in bucket ", b);
        bucket.segments.push_back(s);
      }
    }
    bucket.f32_count = *std::max_element(f32_run.begin(), f32_run.end());
    CHECK(bucket.piece * world <= region_.bucket_bf16_elements && bucket.f32_count * world <= region_.bucket_f32_elements,
          "train state: bucket ", b, " does not fit the planned all-gather staging");
    buckets_.push_back(std::move(bucket));
  }
  CHECK(static_cast<int>(dense_weight_at.size()) == dense_.num_tensors(), "train state: ", dense_weight_at.size(),
        " own bucket segments for ", dense_.num_tensors(), " dense pieces");
  CHECK(piece_total == region_.piece_bf16_elements, "train state: ", piece_total, " piece elements, the region plans ",
        region_.piece_bf16_elements);
  // The all-gather stages in the gradient region, idle at the step end (every group reduced) and
  // zeroed again at the next step's start.
  char* region = reinterpret_cast<char*>(group_region_);
  piece_bf16_ = reinterpret_cast<__nv_bfloat16*>(region + region_.piece_bf16_at);
  bucket_bf16_ = reinterpret_cast<__nv_bfloat16*>(region + region_.bucket_bf16_at);
  bucket_f32_ = reinterpret_cast<float*>(region + region_.bucket_f32_at);
  for (const int64_t at : dense_weight_at) dense_weights_.push_back(piece_bf16_ + at);
  // AdamW's masters per piece: the expert slices' split halves (DeviceParams') or fp32 in master_.
  std::vector<MasterSpan> expert_masters;
  if (experts_split_) {
    for (const ParamEntry& piece : experts_.entries())
      expert_masters.push_back(params_->split_master_span(piece.name));
  } else {
    expert_masters = flat_master_spans(experts_, master_at(0), expert_weights_);
  }
  const size_t moment = dtype_size(adamw_.moment_dtype);
  if (experts_.num_tensors() > 0)
    expert_plan_ = std::make_unique<AdamWLaunchPlan>(experts_, adamw_.moment_dtype, expert_masters, expert_grads_,
                                                     exp_avg_.data(), exp_avg_sq_.data());
  if (dense_.num_tensors() > 0)
    adamw_plan_ = std::make_unique<AdamWLaunchPlan>(
        dense_, adamw_.moment_dtype, flat_master_spans(dense_, master_at(dense_base_), dense_weights_),
        flat_gradient_spans(dense_, piece_grads_.as<float>()),
        exp_avg_.as<char>() + dense_base_ * static_cast<int64_t>(moment),
        exp_avg_sq_.as<char>() + dense_base_ * static_cast<int64_t>(moment));

  // The phases in backward order and, for each, how many groups are complete once it is.
  CHECK(layout_->num_groups() == 0 || !phases.empty() || layout_->num_groups() == 1,
        "train state: the layout has ", layout_->num_groups(), " gradient groups but no phases were given");
  int done = 0;
  for (int p = 0; p < static_cast<int>(phases.size()); ++p) {
    phase_ids_.push_back(phases[static_cast<size_t>(p)].id);
    done = std::max(done, layout_->group_of_phase(p) + 1);
    groups_done_after_.push_back(done);
  }
}

size_t DeviceTrainState::sharded_step_bytes() const { return piece_grads_.bytes(); }

float* DeviceTrainState::master_at(int64_t state_offset) const {
  CHECK(state_offset >= master_base_, "train state: element ", state_offset, " of the state has no fp32 master here");
  return master_.as<float>() + (state_offset - master_base_);
}

void DeviceTrainState::upload_master(const std::string& name, int64_t first, int64_t count, const void* host,
                                     DType dtype) {
  CHECK(sharded(), "train state: upload_master is for a rank's pieces");
  const size_t element = dtype_size(dtype);
  std::vector<float> values;
  const auto [begin, end] = pieces_of_.equal_range(name);
  for (auto it = begin; it != end; ++it) {
    // A split master took these values with the weights (DeviceParams::upload).
    if (split_piece(it->second)) continue;
    const ParamEntry& piece = layout_->state().entry(it->second);
    const int64_t lo = std::max(first, piece.tensor_begin), hi = std::min(first + count, piece.tensor_begin + piece.numel);
    if (lo >= hi) continue;
    values.resize(static_cast<size_t>(hi - lo));
    convert_floats(static_cast<const uint8_t*>(host) + static_cast<size_t>(lo - first) * element, dtype, values.data(),
                   DType::f32, hi - lo);
    CUDA_CHECK(cudaMemcpy(master_at(piece.offset + (lo - piece.tensor_begin)), values.data(),
                          values.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
}

void DeviceTrainState::randomize_master(uint64_t seed) {
  CHECK(sharded(), "train state: randomize_master is for a rank's pieces");
  // Split masters took their values with the weights (DeviceParams::randomize, the same rule).
  const ParamLayout& state = layout_->state();
  for (int i = 0; i < state.num_tensors(); ++i) {
    const ParamEntry& piece = state.entry(i);
    if (!split_piece(i))
      params_->init_values(piece.name, piece.tensor_begin, piece.numel, seed, master_at(piece.offset), stream_);
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void DeviceTrainState::zero_gradients(bool leave_written_first) {
  params_->zero_gradients(stream_, leave_written_first);
  if (sharded()) CUDA_CHECK(cudaMemsetAsync(piece_grads_.data(), 0, piece_grads_.bytes(), stream_));
}

void DeviceTrainState::begin_backward() {
  next_group_ = 0;
  last_phase_ = -1;
}

void DeviceTrainState::gradients_ready(GradientPhaseId phase) {
  if (!sharded()) return;
  int p = last_phase_ + 1;
  while (p < static_cast<int>(phase_ids_.size()) && !(phase_ids_[static_cast<size_t>(p)] == phase)) ++p;
  CHECK(p < static_cast<int>(phase_ids_.size()), "train state: the backward reported ", gradient_phase_name(phase),
        (last_phase_ >= 0 ? str_cat(" after ", gradient_phase_name(phase_ids_[static_cast<size_t>(last_phase_)]))
                          : std::string()),
        ", out of the backward order of the layout's gradient groups");
  for (int q = last_phase_ + 1; q < p; ++q) {
    CHECK(layout_->group_of_phase(q) < 0, "train state: the backward reported ", gradient_phase_name(phase),
          " before ", gradient_phase_name(phase_ids_[static_cast<size_t>(q)]),
          ", whose trained gradients share memory with it");
  }
  last_phase_ = p;
  reduce_groups_before(groups_done_after_[static_cast<size_t>(p)]);
}

void DeviceTrainState::end_backward() {
  if (!sharded()) return;
  reduce_groups_before(layout_->num_groups());
}

void DeviceTrainState::reduce_groups_before(int end_group) {
  const CommStream on{stream_};
  const int rank = layout_->rank();
  for (; next_group_ < end_group; ++next_group_) {
    const int g = next_group_;
    for (int b = layout_->group_first_bucket(g); b < layout_->group_end_bucket(g); ++b) {
      const Bucket& bucket = buckets_[static_cast<size_t>(b)];
      float* mine = bucket.grad + rank * bucket.piece;
      world_->reduce_scatter(bucket.grad, mine, bucket.piece, DType::f32, ReduceOp::sum, on);
      for (const BucketSegment& s : bucket.segments) {
        if (s.rank == rank)
          add_f32_cuda(bucket.grad + s.at, piece_grads_.as<float>() + (s.state_offset - dense_base_), s.count, stream_);
      }
    }
    // The region is all zeros between groups: the next phase accumulates into it from zero.
    CUDA_CHECK(cudaMemsetAsync(group_region_, 0, static_cast<size_t>(layout_->group_padded_elements(g)) * 4, stream_));
  }
}

void DeviceTrainState::reduce_gradients() {
  if (!sharded()) return;
  if (expert_replicas_ != nullptr && expert_replicas_->size() > 1 && expert_elements_ > 0) {
    // bf16 gradients are summed in bf16, as they are stored.
    void* grads = experts_bf16_grad_ ? static_cast<void*>(params_->bf16_gradients())
                                     : static_cast<void*>(params_->gradients());
    expert_replicas_->all_reduce(grads, grads, expert_elements_, experts_bf16_grad_ ? DType::bf16 : DType::f32,
                                 ReduceOp::sum, CommStream{stream_});
  }
}

void DeviceTrainState::start_sharded_sum_of_squares(double divisor, const double* expert_sums,
                                                    int64_t num_expert_sums) {
  double* result = reinterpret_cast<double*>(norm_scratch_.as<char>() + kSumOfSquaresWorkspaceBytes);
  // [0]: the expert pieces (on the first replica of their block only; every one is written first,
  // so expert_sums covers them), [1]: the dense pieces.
  if (layout_->first_expert_replica() && expert_elements_ > 0 && expert_sums != nullptr) {
    sum_of_squares_cuda(nullptr, 0, expert_sums, num_expert_sums, divisor, result, norm_scratch_.data(), stream_);
  } else if (layout_->first_expert_replica() && expert_elements_ > 0 && experts_bf16_grad_) {
    sum_of_squares_cuda(params_->bf16_gradients(), expert_elements_, divisor, result, norm_scratch_.data(), stream_);
  } else if (layout_->first_expert_replica() && expert_elements_ > 0) {
    sum_of_squares_cuda(params_->gradients(), expert_elements_, divisor, result, norm_scratch_.data(), stream_);
  } else {
    CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(double), stream_));
  }
  if (dense_.total_numel() > 0) {
    sum_of_squares_cuda(piece_grads_.as<float>(), dense_.total_numel(), divisor, result + 1, norm_scratch_.data(),
                        stream_);
  } else {
    CUDA_CHECK(cudaMemsetAsync(result + 1, 0, sizeof(double), stream_));
  }
  world_->all_reduce(result, result, 2, DType::f64, ReduceOp::sum, CommStream{stream_});
  CUDA_CHECK(cudaMemcpyAsync(norm_host_, result, 2 * sizeof(double), cudaMemcpyDeviceToHost, stream_));
}

void DeviceTrainState::sharded_adamw_step(double lr, const GradientScaling& scaling) {
  const int64_t step = adam_step_ + 1;
  if (expert_plan_ != nullptr) expert_plan_->step(adamw_, lr, step, scaling, stream_);
  if (adamw_plan_ != nullptr) adamw_plan_->step(adamw_, lr, step, scaling, stream_);
  adam_step_ = step;
  gather_weights();
}

void DeviceTrainState::gather_weights() {
  const CommStream on{stream_};
  const int rank = layout_->rank();
  __nv_bfloat16* gathered = bucket_bf16_;
  float* gathered_f32 = bucket_f32_;
  // A mirrored world (the simulator) returns this rank's block in every slot: the other pieces keep
  // their weights (their owners' update is not known here) instead of taking copies of this one's.
  const bool own_only = world_->mirrored();
  for (const Bucket& bucket : buckets_) {
    world_->all_gather(piece_bf16_ + bucket.piece_bf16_at, gathered, bucket.piece, DType::bf16, on);
    for (const BucketSegment& s : bucket.segments) {
      if (!own_only || s.rank == rank) copy_async(s.weight, gathered + s.at, s.count * 2, stream_);
    }
    if (bucket.f32_count == 0) continue;
    // The fp32 values of the tensors read in fp32: each rank's run of them, packed, in place.
    float* mine = gathered_f32 + rank * bucket.f32_count;
    for (const BucketSegment& s : bucket.segments) {
      if (s.rank == rank && s.f32 != nullptr)
        copy_async(mine + s.f32_at, master_at(s.state_offset), s.count * 4, stream_);
    }
    world_->all_gather(mine, gathered_f32, bucket.f32_count, DType::f32, on);
    for (const BucketSegment& s : bucket.segments) {
      if (s.f32 != nullptr && (!own_only || s.rank == rank))
        copy_async(s.f32, gathered_f32 + s.rank * bucket.f32_count + s.f32_at, s.count * 4, stream_);
    }
  }
}

void DeviceTrainState::restore_sharded_weights() {
  // Split expert masters: their high halves are the weights already (write_state put them there).
  for (int i = 0; i < experts_.num_tensors() && !experts_split_; ++i) {
    const ParamEntry& piece = experts_.entry(i);
    master_weights_cuda(master_at(piece.offset), expert_weights_[static_cast<size_t>(i)], piece.numel, stream_);
  }
  for (int i = 0; i < dense_.num_tensors(); ++i) {
    const ParamEntry& piece = dense_.entry(i);
    master_weights_cuda(master_at(dense_base_ + piece.offset), dense_weights_[static_cast<size_t>(i)], piece.numel,
                        stream_);
  }
  gather_weights();
}

}  // namespace deltamoe
