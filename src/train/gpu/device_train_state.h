// DeviceTrainState: the GPU engine's training state — the model's parameters (DeviceParams: bf16
// weights, fp32 master, gradients (fp32; the routed experts' bf16), fp32 copies of frozen tensors
// read in fp32) plus the AdamW
// moments of the trained ones — and the optimizer step on the device (global norm, clipping,
// AdamW writing the new bf16 weights). It is the engine's TrainStateStore: host copies are made
// only to save or resume.
// On one rank of a parallel job (the sharded constructor) it holds this rank's pieces of the
// ParallelLayout: its own routed experts whole (bf16 weights, master, gradient, moments; the master
// split as on one GPU, its bf16 weight plus a low half kept by DeviceParams) and, under ZeRO-2,
// only its piece of each dense bucket's fp32 master, moments and reduced gradient; the
// dense bf16 weights stay full on every rank. The dense gradients never exist whole: every gradient
// group (one backward phase: a decoder layer, the loss head, a vision block) is placed at the start
// of one shared region, and as the backward reports a phase finished (gradients_ready) its buckets
// are reduce-scattered in place, this rank's sums added to its pieces, and the region zeroed for the
// next phase — one phase's gradient resident instead of the whole model's. The norm sums every
// rank's pieces, AdamW updates the own pieces and writes their bf16 values, and an all-gather per
// bucket brings everyone's updated weights (device_sharded_state.cc).
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
#include "model/gradient_phases.h"
#include "train/parallel_layout.h"
#include "train/sharded_region.h"

namespace deltamoe {

class DeviceTrainState : public TrainStateStore {
 public:
  // One rank alone: every trained tensor whole.
  DeviceTrainState(const std::vector<DeviceParamSpec>& specs, const AdamWConfig& adamw, cudaStream_t stream);
  // One rank of `world` (a device communicator) holding layout.state()'s pieces. specs: the
  // routed-expert stacks this rank owns as slices ([E_local, ...]), trained ones first and in
  // layout.full()'s order (checked); every other tensor whole. expert_replicas: the ranks holding
  // the same expert block (null: one each). phases: the list the layout's groups were made from
  // (backward_gradient_phases). layout and the communicators must outlive this.
  DeviceTrainState(const std::vector<DeviceParamSpec>& specs, const AdamWConfig& adamw, cudaStream_t stream,
                   const ParallelLayout& layout, Communicator& world, Communicator* expert_replicas,
                   const std::vector<GradientPhase>& phases);
  ~DeviceTrainState() override;
  DeviceTrainState(const DeviceTrainState&) = delete;
  DeviceTrainState& operator=(const DeviceTrainState&) = delete;

  DeviceParams& params() { return *params_; }
  const DeviceParams& params() const { return *params_; }
  size_t moment_bytes() const { return exp_avg_.bytes() + exp_avg_sq_.bytes(); }
  bool sharded() const { return layout_ != nullptr; }
  // Device bytes of the masters (fp32, and the low halves of split ones; sharded: this rank's
  // pieces) and of the sharded step's own buffer (the reduced gradient pieces; the staging shares
  // the gradient region; 0 on one rank).
  size_t master_bytes() const;
  size_t sharded_step_bytes() const;

  // Sharded: the master values of the model's tensor `name`, elements [first, first + count) in
  // the whole tensor's indices (host, any float dtype); the pieces this rank holds keep theirs.
  // Synchronous. (The bf16 weights and fp32 copies come from DeviceParams::upload.)
  void upload_master(const std::string& name, int64_t first, int64_t count, const void* host, DType dtype);
  // Sharded: every piece's master by its tensor's init rule (DeviceParams::randomize's values).
  void randomize_master(uint64_t seed);

  // Zeroes every gradient (and, sharded, the reduced pieces): the step's start. With
  // leave_written_first, not the gradients the step's first product writes
  // (DeviceParams::set_written_first).
  void zero_gradients(bool leave_written_first = false);
  // Sharded, around each training micro-batch's backward (no-ops on one rank): begin_backward,
  // then gradients_ready(phase) as the models finish each phase, in backward order, then
  // end_backward. Each reduce-scatters, in group order, the groups finished so far and not yet
  // reduced; end_backward the rest (all of them when the micro-batch ran no backward), so every
  // rank issues the same collectives in the same order. A phase whose gradients were written but
  // never reported would have shared memory with the next: a phase reported after a later one, or
  // one skipped while holding trained tensors, is refused. Queued on the stream; no host sync.
  void begin_backward();
  void gradients_ready(GradientPhaseId phase);
  void end_backward();
  // Sharded, at the step end: the expert gradients summed over their replicas (the dense ones were
  // reduced during the backward). Queued on the stream; no host sync.
  void reduce_gradients();
  // Queues the gradient's sum of squares (divided by divisor first) into a device double and
  // starts its copy to pinned host memory; finish_sum_of_squares() waits for it (the step's one
  // host sync: the norm decides whether and how much to clip). Sharded: the sum over every rank's
  // pieces (expert pieces counted on their first replica only), all-reduced before the copy.
  // expert_sums (null: none): num_expert_sums device doubles holding the sums of squares of every
  // written-first gradient (DeviceParams::set_written_first: the routed experts'), formed as the
  // backward wrote them (GpuTextModel::ExpertSquaresSink); those gradients are then not read.
  // Only where expert_sums_usable().
  void start_sum_of_squares(double divisor, const double* expert_sums = nullptr, int64_t num_expert_sums = 0);
  // Whether the written-first gradients are final when the backward has written them: not when
  // expert replicas sum them afterwards (reduce_gradients).
  bool expert_sums_usable() const {
    return !sharded() || expert_replicas_ == nullptr || expert_replicas_->size() <= 1;
  }
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
  // A run of one dense tensor inside a bucket of the full weights.
  struct BucketSegment {
    int rank = 0;              // whose piece it lies in
    int64_t at = 0;            // element of the bucket (= rank * piece + position in that piece)
    int64_t count = 0;
    __nv_bfloat16* weight = nullptr;
    float* f32 = nullptr;      // their fp32 working copy (tensors read in fp32), else null
    int64_t f32_at = -1;       // position in its rank's packed fp32 run of the bucket
    int64_t state_offset = -1;  // own segments: where they are in layout().state()
  };
  struct Bucket {
    int64_t piece = 0;     // elements of every rank's piece
    float* grad = nullptr;  // its gradient: world * piece values in the shared group region
    int64_t piece_bf16_at = 0;  // where this rank's piece lies in piece_bf16_
    int64_t f32_count = 0;  // most fp32-read elements any rank's piece holds (0: none)
    std::vector<BucketSegment> segments;
  };
  void* address(StateKind kind, int index, int64_t first, int64_t count) const;
  void setup_sharded(const std::vector<GradientPhase>& phases);
  void reduce_groups_before(int end_group);
  void start_sharded_sum_of_squares(double divisor, const double* expert_sums, int64_t num_expert_sums);
  void sharded_adamw_step(double lr, const GradientScaling& scaling);
  void restore_sharded_weights();
  void gather_weights();
  // Sharded: whether state piece `index`'s master is split (kept by DeviceParams: the rank's
  // expert slices when their masters are split), and where an fp32 one lies in master_.
  bool split_piece(int index) const { return experts_split_ && index < experts_.num_tensors(); }
  float* master_at(int64_t state_offset) const;

  std::unique_ptr<DeviceParams> params_;
  AdamWConfig adamw_;
  cudaStream_t stream_;
  DeviceBuffer exp_avg_, exp_avg_sq_;
  DeviceBuffer norm_scratch_;  // the reduction's partials + the result (sharded: two results)
  double* norm_host_ = nullptr;  // pinned, two doubles
  int64_t adam_step_ = 0;
  std::vector<GradientSpan> grads_of_pieces_;  // one rank: AdamW's gradient per piece (DeviceParams')
  // AdamW's launches over the trained pieces (sharded: over dense_, the experts' in expert_plan_),
  // built once their addresses are known.
  std::unique_ptr<AdamWLaunchPlan> adamw_plan_;
  std::unique_ptr<AdamWLaunchPlan> expert_plan_;

  // Sharded only.
  const ParallelLayout* layout_ = nullptr;
  Communicator* world_ = nullptr;
  Communicator* expert_replicas_ = nullptr;
  DeviceBuffer master_;        // layout().state() from master_base_ on, fp32
  int64_t master_base_ = 0;    // the first state element with an fp32 master here (after split experts)
  bool experts_split_ = false;  // the expert pieces' masters are split (DeviceParams holds them)
  DeviceBuffer piece_grads_;   // dense_ layout, fp32: this rank's reduced pieces, summed over micro-batches
  // The all-gather's staging, in the gradient region at the step end (sharded_region.h): every
  // bucket's own piece in bf16 (AdamW's output, the all-gather input), one gathered bf16 bucket, and
  // world x the largest fp32-read run of a piece (the fp32 all-gather).
  ShardedRegion region_;
  __nv_bfloat16* piece_bf16_ = nullptr;
  __nv_bfloat16* bucket_bf16_ = nullptr;
  float* bucket_f32_ = nullptr;
  ParamLayout experts_, dense_;  // the expert pieces and the dense pieces of the state, each from 0
  int64_t dense_base_ = 0;       // state offset of dense_'s element 0
  int64_t expert_elements_ = 0;  // expert pieces' span at the front of the state (and of their gradients)
  std::vector<__nv_bfloat16*> expert_weights_, dense_weights_;  // AdamW's bf16 outputs per piece
  // The expert slices' gradients per piece, where the backward wrote them (DeviceParams', bf16
  // where their specs say); the dense pieces' are in piece_grads_.
  std::vector<GradientSpan> expert_grads_;
  bool experts_bf16_grad_ = false;  // the expert slices' gradients are bf16 (all of them or none)
  std::vector<Bucket> buckets_;
  float* group_region_ = nullptr;   // where every dense gradient group lives while it is being built
  std::vector<GradientPhaseId> phase_ids_;  // the layout's phases, in backward order
  std::vector<int> groups_done_after_;      // per phase: groups complete once it is (group index + 1)
  int next_group_ = 0;                      // the first group not yet reduced in this micro-batch
  int last_phase_ = -1;                     // the last phase reported in this micro-batch
  std::unordered_multimap<std::string, int> pieces_of_;  // tensor name -> state entries
};

}  // namespace deltamoe
