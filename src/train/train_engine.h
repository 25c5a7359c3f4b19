// The device-agnostic face of a training engine: forward + backward of one packed micro-batch into
// a flat fp32 gradient buffer. The trainer's loop only talks to this, so the CPU reference engine
// (cpu_engine.h) and the GPU engine plug into the same loop.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "data/packer.h"

namespace deltamoe {

// What one micro-batch contributed; the trainer sums these over the global batch.
struct MicroBatchLoss {
  double ce_sum = 0;           // cross-entropy summed over the supervised tokens (after the shift)
  int64_t num_supervised = 0;  // tokens whose shifted label is not -100
  double aux_loss = 0;         // router load-balancing loss of this forward pass, before its coefficient
  int64_t num_tokens = 0;
  // Supervised tokens whose highest logit is the label (token accuracy, as ms-swift's token_acc);
  // -1 when the engine does not compute it.
  int64_t num_correct = -1;
};

// What an engine that plans its memory once (the GPU engine) must know about the batches to come.
struct EngineSizing {
  int64_t max_tokens = 0;   // token budget of one micro-batch (0: unknown)
  int64_t max_samples = 0;  // most samples in one micro-batch (0: limited by tokens only)
};

class TrainEngine {
 public:
  virtual ~TrainEngine() = default;

  // "cpu" or "cuda:<n>", for logs and the metrics file.
  virtual std::string device_name() const = 0;
  // The accelerator's model name (e.g. "NVIDIA H200"), which picks the default peak FLOP/s for
  // MFU; empty for the CPU.
  virtual std::string accelerator_name() const { return ""; }
  // Model FLOPs of forward + backward of this micro-batch, counted as ../shared/baselines.md does
  // (src/train/gpu/bench_flops.h); 0 when the engine does not report MFU (the CPU reference).
  virtual double training_flops(const MicroBatch& batch) const { return 0.0; }
  // Most device memory in use so far (bytes, CUDA context included); 0 when not measured.
  virtual size_t peak_memory_bytes() const { return 0; }

  // Makes the engine compute with these weights: the flat fp32 master buffer of the trainer's
  // ParamLayout (trainable tensors only; frozen ones stay as loaded). Called once at the start and
  // after every optimizer step.
  virtual void set_trainable_weights(const float* master) = 0;

  // Forward and backward of one micro-batch. The backward is seeded so that the gradient of
  //   ce_token_weight * ce_sum + aux_weight * aux_loss
  // is ADDED to grad (flat layout, every trainable tensor at its offset).
  virtual MicroBatchLoss forward_backward(const MicroBatch& batch, double ce_token_weight, double aux_weight,
                                          float* grad) = 0;

  // Forward only (evaluation). When logits is not null it receives [T, V] fp32.
  virtual MicroBatchLoss forward(const MicroBatch& batch, std::vector<float>* logits = nullptr) = 0;
};

// Labels of a packed micro-batch shifted inside each sample: shifted[i] = labels[i + 1] when token
// i + 1 belongs to the same sample, else -100 (a sample never predicts the next sample's first token).
std::vector<int64_t> shift_packed_labels(const MicroBatch& batch);

}  // namespace deltamoe
