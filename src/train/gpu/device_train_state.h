// DeviceTrainState: the GPU engine's training state — the model's parameters (DeviceParams: bf16
// weights, fp32 master, fp32 gradients, fp32 copies of frozen tensors read in fp32) plus the AdamW
// moments of the trained ones — and the optimizer step on the device (global norm, clipping,
// AdamW writing the new bf16 weights). It is the engine's TrainStateStore: host copies are made
// only to save or resume.
// On one rank of a parallel job (the sharded constructor) it holds this rank's pieces of the
// ParallelLayout: its own routed experts whole (bf16 weights, master, gradient, moments) and, under
// ZeRO-2, only its piece of each dense bucket's fp32 master and moments; the dense bf16 weights
// and fp32 gradients stay full on every rank. The step end reduce-scatters each bucket's gradient
// (reduce_gradients), the norm sums every rank's pieces, AdamW updates the own pieces and writes
// their bf16 values, and an all-gather per bucket brings everyone's updated weights
// (device_sharded_state.cc).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <unordered_map>
#include <vector>

#include "core/device_buffer.h"
#include "model/gpu/device_params.h"
#include "optim/adamw.h"
#include "optim/adamw_cuda.h"
#include "optim/train_state.h"
#include "parallel/communicator.h"
#include "train/parallel_layout.h"

namespace deltamoe {

class DeviceTrainState : public TrainStateStore {
 public:
  // One rank alone: every trained tensor whole.
  DeviceTrainState(const std::vector<DeviceParamSpec>& specs, const AdamWConfig& adamw, cudaStream_t stream);
  // One rank of `world` (a device communicator) holding layout.state()'s pieces. specs: the
  // routed-expert stacks this rank owns as slices ([E_local, ...]), trained ones first and in
  // layout.full()'s order (checked); every other tensor whole. expert_replicas: the ranks holding
  // the same expert block (null: one each). layout and the communicators must outlive this.
  DeviceTrainState(const std::vector<DeviceParamSpec>& specs, const AdamWConfig& adamw, cudaStream_t stream,
                   const ParallelLayout& layout, Communicator& world, Communicator* expert_replicas);
  ~DeviceTrainState() override;
  DeviceTrainState(const DeviceTrainState&) = delete;
  DeviceTrainState& operator=(const DeviceTrainState&) = delete;

  DeviceParams& params() { return *params_; }
  const DeviceParams& params() const { return *params_; }
  size_t moment_bytes() const { return exp_avg_.bytes() + exp_avg_sq_.bytes(); }
  bool sharded() const { return layout_ != nullptr; }
  // Device bytes of the fp32 master (sharded: this rank's pieces) and of the sharded step's
  // buffers (reduced gradient pieces, the bucket staging); 0 for the latter on one rank.
  size_t master_bytes() const;
  size_t sharded_step_bytes() const;

  // Sharded: the master values of the model's tensor `name`, elements [first, first + count) in
  // the whole tensor's indices (host, any float dtype); the pieces this rank holds keep theirs.
  // Synchronous. (The bf16 weights and fp32 copies come from DeviceParams::upload.)
  void upload_master(const std::string& name, int64_t first, int64_t count, const void* host, DType dtype);
  // Sharded: every piece's master by its tensor's init rule (DeviceParams::randomize's values).
  void randomize_master(uint64_t seed);

  // Sharded, at the step end after the last micro-batch's backward: each dense bucket's gradient
  // reduce-scattered over the world in bucket order (this rank keeps the sum of its piece), and
  // the expert gradients summed over their replicas. Queued on the stream; no host sync.
  void reduce_gradients();
  // Queues the gradient's sum of squares (divided by divisor first) into a device double and
  // starts its copy to pinned host memory; finish_sum_of_squares() waits for it (the step's one
  // host sync: the norm decides whether and how much to clip). Sharded: the sum over every rank's
  // pieces (expert pieces counted on their first replica only), all-reduced before the copy.
  void start_sum_of_squares(double divisor);
  double finish_sum_of_squares();
  // One AdamW update of every trained piece (adam_step() advances), with the gradient scaled as
  // `scaling` says; the bf16 weights get bf16(master). No host sync. Sharded: a collective; the
  // updated dense weights are all-gathered per bucket afterwards.
  void adamw_step(double lr, const GradientScaling& scaling);
  // Tests: the gradient AdamW reads for piece `index` of layout() (unscaled; sharded: after
  // reduce_gradients). Synchronous.
  std::vector<float> read_piece_gradient(int index) const;

  // TrainStateStore
  const ParamLayout& layout() const override { return layout_ != nullptr ? layout_->state() : params_->trained_layout(); }
  const AdamWConfig& adamw_config() const override { return adamw_; }
  int64_t adam_step() const override { return adam_step_; }
  void set_adam_step(int64_t adam_step) override;
  void read_state(StateKind kind, int index, int64_t first, int64_t count, void* host) const override;
  void write_state(StateKind kind, int index, int64_t first, int64_t count, const void* host) override;
  // Sharded: a collective (every rank restores together): the bf16 weights rebuilt from the
  // pieces' masters and all-gathered.
  void state_restored() override;

 private:
  // A run of one dense tensor inside a bucket of the full gradient/weights.
  struct BucketSegment {
    int rank = 0;              // whose piece it lies in
    int64_t at = 0;            // element of the bucket (= rank * piece + position in that piece)
    int64_t count = 0;
    float* grad = nullptr;     // the full fp32 gradient of these elements
    __nv_bfloat16* weight = nullptr;
    float* f32 = nullptr;      // their fp32 working copy (tensors read in fp32), else null
    int64_t f32_at = -1;       // position in its rank's packed fp32 run of the bucket
    int64_t state_offset = -1;  // own segments: where they are in layout().state()
  };
  struct Bucket {
    int64_t elements = 0;  // of the bucket (before padding)
    int64_t piece = 0;     // elements of every rank's piece
    int64_t piece_bf16_at = 0;  // where this rank's piece lies in piece_bf16_
    int64_t f32_count = 0;  // most fp32-read elements any rank's piece holds (0: none)
    std::vector<BucketSegment> segments;
  };
  void* address(StateKind kind, int index, int64_t first, int64_t count) const;
  float* master_data() const;
  void setup_sharded();
  void start_sharded_sum_of_squares(double divisor);
  void sharded_adamw_step(double lr, const GradientScaling& scaling);
  void restore_sharded_weights();
  void gather_weights();

  std::unique_ptr<DeviceParams> params_;
  AdamWConfig adamw_;
  cudaStream_t stream_;
  DeviceBuffer exp_avg_, exp_avg_sq_;
  DeviceBuffer norm_scratch_;  // partial sums + the result (sharded: two results)
  double* norm_host_ = nullptr;  // pinned, two doubles
  int64_t adam_step_ = 0;
  std::vector<__nv_bfloat16*> weights_of_pieces_;

  // Sharded only.
  const ParallelLayout* layout_ = nullptr;
  Communicator* world_ = nullptr;
  Communicator* expert_replicas_ = nullptr;
  DeviceBuffer master_;        // layout().state(), fp32
  DeviceBuffer piece_grads_;   // dense_ layout, fp32: this rank's reduced pieces
  DeviceBuffer piece_bf16_;    // every bucket's own piece, bf16 (AdamW's output, the all-gather input)
  DeviceBuffer bucket_f32_;    // one bucket, world x piece fp32 (reduce-scatter; the fp32 all-gather)
  DeviceBuffer bucket_bf16_;   // one bucket, world x piece bf16 (the all-gather's output)
  ParamLayout experts_, dense_;  // the expert pieces and the dense pieces of the state, each from 0
  int64_t dense_base_ = 0;       // state offset of dense_'s element 0
  int64_t expert_elements_ = 0;  // expert pieces' span at the front of the state and of the gradients
  std::vector<__nv_bfloat16*> expert_weights_, dense_weights_;  // AdamW's bf16 outputs per piece
  std::vector<Bucket> buckets_;
  std::unordered_multimap<std::string, int> pieces_of_;  // tensor name -> state entries
};

}  // namespace deltamoe
