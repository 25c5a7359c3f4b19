// CUDA AdamW over the same flat buffers as the CPU AdamW (optim/adamw.h), bit for bit its
// arithmetic (every operation rounded alone, no fused multiply-add), also writing the bf16 copy
// of the weights that the forward reads, or keeping the master split into that copy and a low half
// (split_master.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/device_buffer.h"
#include "optim/adamw.h"
#include "optim/param_layout.h"

namespace deltamoe {

// How the accumulated gradient becomes the one AdamW steps with, as the CPU engine does it in place
// (divide_gradient, then scale_in_place when clipping): g = fl32(fl64(g) / divisor) unless the
// divisor is 1, then g = fl32(g * clip_coef) when clip_coef < 1. Applied on the fly: the gradient
// buffer is only read.
struct GradientScaling {
  double divisor = 1.0;
  float clip_coef = 1.0f;
};

// Where a span's fp32 master lives: an fp32 array (f32; weights_bf16, when not null, is written
// with its bf16 copy, the high half a split master would keep: ties away from zero), or split
// (split_master.h): the bf16 working weights (weights_bf16, the high halves) and `low`, the low
// halves. Exactly one of f32 and low is set.
struct MasterSpan {
  float* f32 = nullptr;
  __nv_bfloat16* weights_bf16 = nullptr;
  uint16_t* low = nullptr;
};

// Where a span's accumulated gradient lives: its first element, fp32 or bf16 (the routed experts'
// gradients, device_params.h). A bf16 gradient is widened exactly, so the update is the one the
// fp32 form gives for the same values.
struct GradientSpan {
  const void* data = nullptr;
  DType dtype = DType::f32;
};

// adamw_update_span on the device: count elements; master as `master` says (the span's first
// element at each pointer); grad f32 or bf16; m, v of moment_dtype (f32 or bf16), updated in place;
// grad scaled as `scaling` says.
void adamw_update_span_cuda(const AdamWStepScalars& scalars, bool decay, DType moment_dtype, int64_t count,
                            const MasterSpan& master, const GradientSpan& grad, const GradientScaling& scaling,
                            void* m, void* v, cudaStream_t stream);

// A layout's AdamW launches, prepared once (the engines build one at setup and step it every
// optimizer step: nothing is allocated or copied then). A piece that fills the grid on its own
// (own_launch_blocks blocks of 256 threads: the experts' stacks, the embedding) keeps a launch of
// its own; the other pieces of a kind (fp32 or bf16 gradient, fp32 or split master) share one
// launch that finds each block's piece in a device table. A layer of 35B widths has ~16 small
// dense pieces: one launch each cost ~2.6 us of idle GPU between them. masters and grads have one
// entry per piece, m and v are the layout's flat buffers (padding left untouched); the learning
// rate of each piece is lr times its lr_scale (at most 8 different multipliers).
class AdamWLaunchPlan {
 public:
  static constexpr int32_t kGridBlocks = 65535;  // a piece's blocks at most (a grid-stride loop past that)
  AdamWLaunchPlan(const ParamLayout& layout, DType moment_dtype, const std::vector<MasterSpan>& masters,
                  const std::vector<GradientSpan>& grads, void* m, void* v, int32_t own_launch_blocks = kGridBlocks);
  ~AdamWLaunchPlan();
  AdamWLaunchPlan(AdamWLaunchPlan&&) noexcept;
  AdamWLaunchPlan& operator=(AdamWLaunchPlan&&) noexcept;

  // One update of every piece with adam_step counted from 1 (the value after the increment).
  void step(const AdamWConfig& config, double lr, int64_t adam_step, const GradientScaling& scaling,
            cudaStream_t stream) const;
  int num_launches() const;

 private:
  struct Launch;
  DType moment_dtype_;
  std::vector<double> lr_scales_;  // a step's scalar set s uses lr * lr_scales_[s]
  std::vector<Launch> launches_;
  DeviceBuffer table_;             // the grouped launches' span tasks, then their first blocks
  size_t first_blocks_offset_ = 0;
};

// One update of every piece of layout through a plan built for this call (it allocates the plan's
// table and waits for the launches before freeing it: tests and one-off callers; the engines keep
// an AdamWLaunchPlan).
void adamw_step_cuda(const ParamLayout& layout, const AdamWConfig& config, double lr, int64_t adam_step,
                     const GradientScaling& scaling, const std::vector<MasterSpan>& masters,
                     const std::vector<GradientSpan>& grads, void* m, void* v, cudaStream_t stream);

// The gradient spans of a flat fp32 gradient buffer laid out as `layout` (entry offsets).
std::vector<GradientSpan> flat_gradient_spans(const ParamLayout& layout, const float* grad);

// The master spans of a flat fp32 master buffer laid out as `layout` (entry offsets), each with
// its bf16 copy at weights_bf16[i] (null: none).
std::vector<MasterSpan> flat_master_spans(const ParamLayout& layout, float* master,
                                          const std::vector<__nv_bfloat16*>& weights_bf16);

}  // namespace deltamoe
