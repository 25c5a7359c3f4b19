// DeviceParams: the one owner of a model's parameters on the device — the bf16 working weights of
// every tensor, the fp32 master and the gradients of the trained ones (fp32, or bf16 where the spec
// says: the routed experts'), and fp32 copies of the frozen tensors the math reads in fp32. A trained tensor the math reads only in bf16 may keep its
// master split (optim/split_master.h): its bf16 weight is the master's high half and a 16-bit low
// half lies beside it, 2 bytes a parameter instead of 4 + AdamW's separate bf16 write. Frozen
// tensors have no master and no gradient. The GPU models read it through typed views (DeviceParam)
// bound once; the engine's training state adds the optimizer moments on top.
// On one rank of a parallel job (master_elsewhere): a tensor may be a slice of the model's (the
// rank's own routed experts, [E_local, ...]), and the fp32 master lives with the sharded training
// state (DeviceTrainState) instead, except a split one (the rank's expert slices), which stays
// here: trained tensors keep their fp32 gradient here where the state places it
// (GradientPlacement: the dense ones share one region, phase by phase), and an fp32 working copy
// when the math reads them in fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/device_buffer.h"
#include "core/dtype.h"
#include "kernels/common/sum_of_squares_cuda.h"
#include "model/device_param.h"
#include "model/param_table.h"
#include "optim/adamw_cuda.h"
#include "optim/param_layout.h"

namespace deltamoe {

struct DeviceParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  bool trained = false;    // master + gradient
  bool needs_f32 = false;  // a frozen tensor keeps an fp32 copy (trained ones read their master)
  InitKind init = InitKind::normal;
  double init_std = 0.02;  // for InitKind::normal
  // A slice of the model's tensor (a rank's own experts): this tensor (`shape`) is elements
  // [full_first, full_first + numel) of the model's tensor of full_numel elements (0: whole).
  // upload() takes the model tensor's element indices and keeps the slice's.
  int64_t full_first = 0;
  int64_t full_numel = 0;
  // A trained tensor's master kept split (optim/split_master.h): the bf16 weight (rounded from the
  // master with ties away from zero) plus a low half, kept here even with master_elsewhere. Not
  // for tensors read in fp32 (their math needs the fp32 values).
  bool master_split = false;
  // The gradient stored in bf16 (a buffer of its own, not placed by GradientPlacement): the routed
  // experts', whose products round each micro-batch's sum to bf16 where autocast rounds a weight
  // gradient, and add later micro-batches in fp32 onto the widened value. Half the bytes the
  // products write and AdamW reads, and half the memory (docs/optimizer.md, "How the engines use
  // it"). Trained tensors read in bf16 only, whose gradients are written first (set_written_first).
  bool grad_bf16 = false;
};

// Where the trained tensors' gradients live when the gradient buffer is not simply the trained
// layout: its size and every trained tensor's offset. Tensors marked aliased share memory with
// others (a parallel rank's dense gradients, reduce-scattered phase by phase during the backward,
// device_train_state.h): their full gradient never exists at once and cannot be read back.
struct GradientPlacement {
  int64_t elements = 0;
  std::unordered_map<std::string, int64_t> offset;
  std::unordered_map<std::string, bool> aliased;
};

struct DeviceParamBytes {
  size_t weights = 0;     // bf16, every tensor
  size_t master = 0;      // trained tensors: fp32, or the low halves of split masters
  size_t gradients = 0;   // fp32 and bf16, trained tensors
  size_t frozen_f32 = 0;  // fp32 copies of frozen tensors read in fp32 (and, master_elsewhere, of trained ones)
};

class DeviceParams {
 public:
  // Allocates every buffer (zeros). Names must be unique. master_elsewhere: no master here
  // (the sharded training state keeps it); trained tensors read in fp32 get an fp32 working copy.
  // gradients: where each trained tensor's gradient lives (null: the trained layout).
  explicit DeviceParams(const std::vector<DeviceParamSpec>& specs, bool master_elsewhere = false,
                        const GradientPlacement* gradients = nullptr);
  DeviceParams(const DeviceParams&) = delete;
  DeviceParams& operator=(const DeviceParams&) = delete;

  // The views of `name`; needs_f32 requires fp32 values (checked).
  DeviceParam param(const std::string& name, bool needs_f32) const;
  DeviceParamLookup lookup() const {
    return [this](const std::string& name, bool needs_f32) { return param(name, needs_f32); };
  }
  bool has(const std::string& name) const { return index_.count(name) != 0; }
  const DeviceParamSpec& spec(const std::string& name) const;

  // Host values (any float dtype) for elements [first, first + count) of tensor `name` (of the
  // model's whole tensor; a slice keeps what falls in it): into the master and the bf16 weight of a
  // trained tensor, into the bf16 weight (and the fp32 copy) of a frozen one or of a trained one
  // whose master is elsewhere. Synchronous; staged through pinned memory.
  void upload(const std::string& name, int64_t first, int64_t count, const void* host, DType dtype);
  // Every tensor by its init rule on the device, seeded (the benchmark's random weights). Synchronous.
  void randomize(uint64_t seed);
  // The init rule's values of elements [first, first + count) of the model's tensor `name` into
  // the device buffer out (what randomize gives those elements), queued on stream.
  void init_values(const std::string& name, int64_t first, int64_t count, uint64_t seed, float* out,
                   cudaStream_t stream) const;
  bool master_elsewhere() const { return master_elsewhere_; }

  // The trained tensors' flat layout (the optimizer's moments follow it) and the fp32 gradient
  // buffer (placed, or the trained tensors with fp32 gradients in spec order; trained_gradients()
  // says where each piece's gradient is).
  const ParamLayout& trained_layout() const { return trained_; }
  float* gradients() const { return grads_.as<float>(); }
  int64_t num_f32_gradients() const { return static_cast<int64_t>(grads_.bytes() / sizeof(float)); }
  // The bf16 gradients (grad_bf16 tensors, in spec order, each at its bf16_gradient_layout offset).
  const ParamLayout& bf16_gradient_layout() const { return bf16_grads_layout_; }
  __nv_bfloat16* bf16_gradients() const { return grads_bf16_.as<__nv_bfloat16>(); }
  // Per trained piece, where AdamW finds its gradient (fp32 or bf16). Not with a placement that
  // aliases gradients (the sharded state gives AdamW its own reduced pieces).
  std::vector<GradientSpan> trained_gradients() const;
  // Per trained piece, where AdamW finds its master: fp32 with its bf16 copy, or split. Not with
  // master_elsewhere.
  std::vector<MasterSpan> trained_masters() const;
  // Where AdamW finds the split master of `name` (its bf16 weight and low half); checked split.
  MasterSpan split_master_span(const std::string& name) const;
  // Elements [first, first + count) of trained piece `index`'s master (fp32 values, split ones
  // joined) to or from the host. Synchronous. Only masters kept here (fp32 without
  // master_elsewhere, or split). write_master leaves an fp32 master's bf16 copy to
  // refresh_trained_weights; a split one's high half is that copy.
  void read_master(int index, int64_t first, int64_t count, float* host) const;
  void write_master(int index, int64_t first, int64_t count, const float* host);
  // Rebuilds every trained tensor's bf16 weight from its fp32 master (after a restore; not with
  // master_elsewhere). Split masters hold theirs already.
  void refresh_trained_weights(cudaStream_t stream) const;
  // Zeroes the gradients; with leave_written_first, not those of the tensors named to
  // set_written_first (their first product of a step writes them: the routed experts', lm_head's),
  // so the step's zeroing pass skips their bytes. Every bf16 gradient must be named there.
  void zero_gradients(cudaStream_t stream, bool leave_written_first = false) const;
  // `names`: written first, their sums of squares formed by the products that write them (when a
  // step asks for them); `norm_reads`: written first, their sums of squares read by the norm.
  void set_written_first(const std::vector<std::string>& names, const std::vector<std::string>& norm_reads = {});
  // The gradient memory outside the tensors of set_written_first's `names`, as a device array of
  // spans: what the gradient norm reads when those tensors' sums of squares are formed by the
  // products that write them.
  const DeviceF32Span* spans_not_written_first() const { return unwritten_spans_.as<DeviceF32Span>(); }
  int num_spans_not_written_first() const { return num_unwritten_spans_; }

  // Tests and parity: the gradient (widened from bf16 where stored so) or the fp32 values (master,
  // or bf16 widened) of one tensor.
  std::vector<float> read_gradient(const std::string& name) const;
  std::vector<float> read_values(const std::string& name) const;

  DeviceParamBytes bytes() const;

 private:
  struct Slot {
    DeviceParamSpec spec;
    int64_t numel = 0;
    int64_t weight_offset = 0;  // in weights_ (bf16 elements)
    int trained_index = -1;     // in trained_ (gradients unless placed elsewhere)
    int64_t master_offset = -1;  // in master_ (fp32 elements): trained tensors with an fp32 master here
    int64_t low_offset = -1;     // in master_low_ (16-bit elements): split masters
    int64_t grad_offset = -1;   // in grads_ (fp32 elements), trained tensors with an fp32 gradient
    int64_t grad_bf16_offset = -1;  // in grads_bf16_ (bf16 elements), trained tensors with a bf16 gradient
    bool grad_aliased = false;  // shares its gradient memory with other tensors
    int64_t frozen_offset = -1;  // in frozen_f32_ (fp32 elements), or -1
  };
  const Slot& slot(const std::string& name) const;
  // Trained piece `index`'s slot, elements [first, first + count) checked against it.
  const Slot& trained_slot(int index, int64_t first, int64_t count) const;
  // Host fp32 values split into their halves and copied to the device, a staging chunk at a time
  // (synchronous).
  static void upload_split(const float* host, int64_t count, __nv_bfloat16* high, uint16_t* low);

  bool master_elsewhere_ = false;
  std::vector<Slot> slots_;
  std::unordered_map<std::string, int> index_;
  // The gradients' own layouts: fp32 ones (unless placed) and bf16 ones, each in spec order.
  ParamLayout weights_layout_, trained_, frozen_layout_, master_layout_, low_layout_, f32_grads_layout_,
      bf16_grads_layout_;
  DeviceBuffer weights_, master_, master_low_, grads_, grads_bf16_, frozen_f32_;
  // The pieces of grads_ zero_gradients(.., true) clears: all but the written-first tensors'
  // (element offset, count), in order.
  std::vector<std::pair<int64_t, int64_t>> zeroed_when_leaving_;
  bool bf16_written_first_ = false;  // set_written_first named every bf16 gradient
  // The pieces outside set_written_first's `names` (zeroed_when_leaving_ and the norm_reads
  // tensors) as DeviceF32Span, on the device.
  DeviceBuffer unwritten_spans_;
  int num_unwritten_spans_ = 0;
};

}  // namespace deltamoe
