// GpuTextModel's sparse MoE block, forward and backward, following the CPU reference
// (src/model/text/moe_block.cc): the router on fp32-exact logits (bf16 hi/lo operands), top-k, the
// routed experts (moe_experts_cuda, locally or through the expert-parallel exchange), the gated
// shared expert, and the aux-loss statistics.
#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/gemm/f32_operand_cuda.h"
#include "kernels/gemm/gemm_cuda.h"
#include "kernels/lora/lora_cuda.h"
#include "kernels/moe_aux_loss/moe_aux_loss_cuda.h"
#include "kernels/moe_experts/moe_experts_cuda.h"
#include "kernels/moe_router/moe_router_cuda.h"
#include "kernels/rms_norm/rms_norm_cuda.h"
#include "kernels/shared_expert/shared_expert_cuda.h"
#include "model/text/gpu/gpu_expert_parallel.h"
#include "model/text/gpu/gpu_text_model.h"
#include "optim/grad_accumulate_cuda.h"

namespace deltamoe {

namespace {

// The one type of a layer's routed-expert gradients (bf16 where the state keeps them so), checked
// alike for gate_up and down where both are trained.
DType expert_grads_dtype(const MoeWeights& W) {
  CHECK(!W.experts_gate_up.trained() || !W.experts_down.trained() ||
            W.experts_gate_up.grad_dtype() == W.experts_down.grad_dtype(),
        "text model: the routed experts' gate_up and down gradients differ in type");
  return W.experts_gate_up.trained() ? W.experts_gate_up.grad_dtype() : W.experts_down.grad_dtype();
}

}  // namespace

void GpuTextModel::split_router_operands(int64_t layer) {
  const LayerActivations& b = acts_.layers[static_cast<size_t>(layer)];
  LayerScratch& w = acts_.scratch;
  const int64_t T = num_tokens_, C = config_.hidden_size, E = config_.num_experts;
  rms_norm_output_low_part_cuda(b.h, weights_.layers[static_cast<size_t>(layer)].post_attention_layernorm.f32, b.rstd_post, b.normed_post,
                                w.router_x_lo, T, C, stream_);
  // w_hi, w_lo: the first two blocks of the stack [w_hi; w_lo; w_hi] (the backward adds the third).
  split_f32_to_bf16_hi_lo_cuda(weights_.layers[static_cast<size_t>(layer)].mlp.gate.f32, w.gate_weight_stack,
                               w.gate_weight_stack + E * C, E * C, stream_);
}

void GpuTextModel::moe_forward(int64_t layer, bool recompute) {
  const TextConfig& c = config_;
  LayerActivations& b = acts_.layers[static_cast<size_t>(layer)];
  MoeSaved& s = b.moe;
  const int64_t T = num_tokens_, C = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  const int64_t Is = c.shared_expert_intermediate_size;
  const MoeWeights& W = weights_.layers[static_cast<size_t>(layer)].mlp;
  split_router_operands(layer);
  moe_router_logits_split_cuda(*gemm_, b.normed_post, acts_.scratch.router_x_lo, acts_.scratch.gate_weight_stack,
                               acts_.scratch.gate_weight_stack + E * C, s.logits, T, C, E, stream_);
  moe_router_forward_cuda(s.logits, s.probs, s.topk_idx, s.topk_weight, T, E, K, stream_);
  // A rerun refills the router's outputs only: the aux statistics already count this layer, the
  // expert-parallel plan of the layer is kept, and the experts' backward recomputes their rows.
  if (!recompute)
    moe_aux_loss_accumulate_cuda(s.probs, s.topk_idx, T, E, K, MoeAuxDeviceStats{inputs_.aux_counts, inputs_.aux_probs},
                                 workspace_.data(), workspace_bytes_, stream_);
  SharedExpertLora shared_lora;
  if (expert_parallel_ != nullptr) {
    if (recompute) return;
    // The count exchange is enqueued and the host waits for it in forward(): the shared expert's
    // products, enqueued in between, keep the GPU busy meanwhile. Its gated output is added after
    // the combine by the same kernel as the fused call below, so the sum is bitwise one rank's.
    expert_parallel_->start_forward(layer, T, s.topk_idx);
    const SharedExpertPending pending =
        shared_expert_pending_in(shared_expert_pending_.data(), shared_expert_pending_.bytes(), T, C);
    shared_expert_forward_products_cuda(*gemm_, b.normed_post, W.shared_gate_proj.w, W.shared_up_proj.w,
                                        W.shared_down_proj.w, W.shared_expert_gate.w, pending, T, C, Is,
                                        workspace_.data(), workspace_bytes_, stream_,
                                        shared_expert_lora(layer, &shared_lora));
    // The bound expert stacks hold this rank's experts only, local expert 0 first.
    expert_parallel_->forward(layer, s.topk_weight, b.normed_post, W.experts_gate_up.w, W.experts_down.w, b.moe_out);
    shared_expert_forward_apply_cuda(pending, b.moe_out, true, T, C, stream_);
    return;
  }
  moe_routing_plan_cuda(s.topk_idx, plans_[static_cast<size_t>(layer)], T, E, K, stream_);
  if (recompute) return;
  const MoeExpertsDims dims{T, C, E, K, c.moe_intermediate_size};
  MoeExpertsLora lora;
  const MoeExpertRows keep{s.input_rows, s.gate_up_rows};
  moe_experts_forward_cuda(dims, plans_[static_cast<size_t>(layer)], b.normed_post, s.topk_weight,
                           W.experts_gate_up.w, W.experts_down.w, b.moe_out, workspace_.data(), workspace_bytes_,
                           stream_, experts_lora(layer, &lora), &keep);
  shared_expert_forward_cuda(*gemm_, b.normed_post, W.shared_gate_proj.w,
                             W.shared_up_proj.w,
                             W.shared_down_proj.w,
                             W.shared_expert_gate.w, b.moe_out, true, T, C, Is,
                             workspace_.data(), workspace_bytes_, stream_, shared_expert_lora(layer, &shared_lora));
}

void GpuTextModel::moe_backward(int64_t layer, const DeviceBf16* dy, float* dx) {
  const TextConfig& c = config_;
  const LayerActivations& b = acts_.layers[static_cast<size_t>(layer)];
  const MoeSaved& s = b.moe;
  LayerScratch& w = acts_.scratch;
  const int64_t T = num_tokens_, C = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  const int64_t Is = c.shared_expert_intermediate_size;
  const MoeWeights& W = weights_.layers[static_cast<size_t>(layer)].mlp;
  const MoeExpertsDims dims{T, C, E, K, c.moe_intermediate_size};
  // The three input gradients (routed experts, router, shared expert) are summed in fp32 into dx;
  // the experts' and the shared expert's arrive as bf16 (acts_.grad_normed, acts_.grad_mixer_bf16: both
  // free until the post-attention norm's backward).
  DeviceBf16* experts_dx = acts_.grad_normed;
  DeviceBf16* shared_dx = acts_.grad_mixer_bf16;
  // The step's first product into this layer's expert gradients writes them (see
  // begin_gradient_step).
  uint8_t& holds_sum = expert_grads_hold_sum_[static_cast<size_t>(layer)];
  const WeightGradOutput expert_grads = holds_sum ? WeightGradOutput::added_to : WeightGradOutput::written;
  // Their sums of squares, when asked for, come with the written products only.
  CHECK(!expert_squares_ || expert_grads == WeightGradOutput::written ||
            (!W.experts_gate_up.trained() && !W.experts_down.trained()),
        "text model: layer ", layer, "'s expert gradients were already formed this step, and their sums of squares "
        "with them; a step that asks for the sums runs one backward");
  ExpertGradSquares squares;
  const bool with_squares = expert_squares_ && expert_grads == WeightGradOutput::written;
  if (with_squares) {
    squares = ExpertGradSquares{expert_squares_->sums + 2 * layer, expert_squares_->sums + 2 * layer + 1,
                                expert_squares_->divisor, expert_squares_->scratch};
  }
  holds_sum = 1;
  if (expert_parallel_ != nullptr) {
    expert_parallel_->backward(layer, s.topk_weight, b.normed_post, W.experts_gate_up.w, W.experts_down.w, dy,
                               experts_dx, w.d_topk_weight, W.experts_gate_up.grad_data(), W.experts_down.grad_data(),
                               expert_grads_dtype(W), expert_grads,
                               with_squares ? &squares : nullptr);
  } else {
    MoeExpertsLora lora;
    const MoeExpertRows kept{s.input_rows, s.gate_up_rows};
    moe_experts_backward_cuda(dims, plans_[static_cast<size_t>(layer)], b.normed_post, s.topk_weight,
                              W.experts_gate_up.w, W.experts_down.w, dy, experts_dx, w.d_topk_weight,
                              W.experts_gate_up.grad_data(), W.experts_down.grad_data(), expert_grads_dtype(W),
                              workspace_.data(), workspace_bytes_,
                              stream_, experts_lora(layer, &lora), expert_grads, with_squares ? &squares : nullptr,
                              &kept);
  }
  const bool with_aux = options_.aux_loss_weight != 0.0f;
  if (with_aux)
    moe_aux_loss_backward_cuda(s.probs, MoeAuxDeviceStats{inputs_.aux_counts, inputs_.aux_probs}, T * c.num_hidden_layers,
                               options_.aux_loss_weight, w.d_logits, false, T, E, stream_);
  moe_router_backward_cuda(s.probs, s.topk_idx, s.topk_weight, w.d_topk_weight, w.d_logits, nullptr, with_aux, T, E,
                           K, stream_);
  // The router's logit gradient stays fp32 (it was rounded to bf16 here): its weight gradient is a
  // sum over tokens that cancels. Every operand is a hi/lo pair (the forward's, remade), with the
  // lo x lo terms left out. Its input gradient is one product written to dx in fp32, of the stacked
  // blocks [dl_hi | dl_hi | dl_lo] [T, 3E] and [w_hi; w_lo; w_hi] [3E, C].
  split_router_operands(layer);
  DeviceBf16* stack = w.gate_weight_stack;
  CUDA_CHECK(cudaMemcpyAsync(stack + 2 * E * C, stack, static_cast<size_t>(E * C) * sizeof(DeviceBf16),
                             cudaMemcpyDeviceToDevice, stream_));
  DeviceBf16* packed = w.gate_grad_packed;
  pack_f32_hi_lo_cuda(w.d_logits, T, E, packed, 3 * E, /*hi_col=*/0, /*lo_col=*/2 * E, /*hi2_col=*/E, stream_);
  linear_backward_input_f32_cuda(*gemm_, packed, stack, dx, false, T, C, 3 * E, stream_);
  if (float* d_router = W.gate.grad; d_router != nullptr) {
    // d_router += dl_hi^T x_hi + dl_lo^T x_hi + dl_hi^T x_lo, the blocks read in place (rows of 3E).
    const auto add_product = [&](const DeviceBf16* dl_block, const DeviceBf16* x_part) {
      gemm_bf16_cuda(*gemm_, true, false, E, C, T, 1.0f, dl_block, 3 * E, x_part, C, 1.0f, d_router, DType::f32, C,
                     stream_);
    };
    add_product(packed, b.normed_post);
    add_product(packed + 2 * E, b.normed_post);
    add_product(packed, w.router_x_lo);
  }
  SharedExpertLora shared_lora;
  shared_expert_backward_cuda(*gemm_, b.normed_post, W.shared_gate_proj.w,
                              W.shared_up_proj.w,
                              W.shared_down_proj.w,
                              W.shared_expert_gate.w, dy, shared_dx, false,
                              W.shared_gate_proj.grad,
                              W.shared_up_proj.grad,
                              W.shared_down_proj.grad,
                              W.shared_expert_gate.grad, T, C, Is, workspace_.data(),
                              workspace_bytes_, stream_, shared_expert_lora(layer, &shared_lora));
  // dx = (router + routed experts) + shared expert, in fp32, in one pass.
  add_bf16_pair_to_f32_cuda(experts_dx, shared_dx, dx, T * C, stream_);
}

const MoeExpertsLora* GpuTextModel::experts_lora(int64_t layer, MoeExpertsLora* out) const {
  const MoeWeights& W = weights_.layers[static_cast<size_t>(layer)].mlp;
  if (!W.experts_gate_up.lora.attached() && !W.experts_down.lora.attached()) return nullptr;
  auto adapter = [](const DeviceLoraViews& v) {
    return v.attached() ? LoraDeviceAdapter{v.a, v.b, v.grad_a, v.grad_b, v.rank, v.scaling} : LoraDeviceAdapter{};
  };
  out->gate_up = adapter(W.experts_gate_up.lora);
  out->down = adapter(W.experts_down.lora);
  out->workspace = lora_experts_workspace_.data();
  out->workspace_bytes = lora_experts_workspace_.bytes();
  return out;
}

const SharedExpertLora* GpuTextModel::shared_expert_lora(int64_t layer, SharedExpertLora* out) const {
  const MoeWeights& W = weights_.layers[static_cast<size_t>(layer)].mlp;
  auto adapter = [](const DeviceLoraViews& v) {
    return v.attached() ? LoraDeviceAdapter{v.a, v.b, v.grad_a, v.grad_b, v.rank, v.scaling} : LoraDeviceAdapter{};
  };
  out->gate_proj = adapter(W.shared_gate_proj.lora);
  out->up_proj = adapter(W.shared_up_proj.lora);
  out->down_proj = adapter(W.shared_down_proj.lora);
  out->expert_gate = adapter(W.shared_expert_gate.lora);
  if (!out->any()) return nullptr;
  out->gemm = gemm_.get();
  out->scratch = lora_scratch_.data();
  out->scratch_bytes = lora_scratch_.bytes();
  out->gate_proj_dropout = lora_dropout_pass(W.shared_gate_proj.lora).mask;
  out->up_proj_dropout = lora_dropout_pass(W.shared_up_proj.lora).mask;
  out->down_proj_dropout = lora_dropout_pass(W.shared_down_proj.lora).mask;
  out->expert_gate_dropout = lora_dropout_pass(W.shared_expert_gate.lora).mask;
  out->dropout_scratch = lora_dropout_scratch_.data();
  out->dropout_scratch_bytes = lora_dropout_scratch_.bytes();
  return out;
}

}  // namespace deltamoe
