// CUDA causal-LM loss head: lm_head + cross-entropy in chunks of tokens, never holding logits for
// the whole batch. Per chunk: bf16 logits [n, V] = X W^T (cuBLASLt, fp32 accumulation), a row
// kernel (fp32 online log-sum-exp, loss, then softmax - onehot written over the logits in place),
// dX = dlogits W and dW += dlogits^T X (the first chunk's = with d_weight_written). Labels arrive
// shifted (cross_entropy.h's shift_labels).
// Legend: T tokens, H hidden, V vocabulary, n chunk rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cross_entropy/lm_head_loss_workspace.h"
#include "kernels/gemm/gemm_cuda.h"

namespace deltamoe {

// Row kernel over given logits [rows, V] bf16 and labels int64 [rows] (-100 ignored).
// token_loss [rows] f32 written (lse - logit[label], 0 when ignored); lse [rows] f32 written.
// With write_grad the logits are overwritten by grad_scale * (softmax - onehot) in bf16 (zeros
// on ignored rows). A label outside [0, V) counts as ignored; when bad_label_position is non-null
// (int32 device scalar zeroed by the caller) 1 + the row of one such label is stored there.
void cross_entropy_rows_cuda(__nv_bfloat16* logits, const int64_t* labels, int64_t rows, int64_t vocab,
                             bool write_grad, float grad_scale, float* token_loss, float* lse,
                             int32_t* bad_label_position, cudaStream_t stream);

// Its scratch: lm_head_cross_entropy_workspace_bytes (lm_head_loss_workspace.h).

struct LmHeadLossArgs {
  const __nv_bfloat16* hidden = nullptr;  // [T, H], the final-normed states
  const __nv_bfloat16* weight = nullptr;  // [V, H], lm_head (or the tied embedding)
  const int64_t* labels = nullptr;        // [T], shifted; -100 ignored
  int64_t num_tokens = 0, hidden_size = 0, vocab = 0;
  // The rows that carry a label (int32 indices into [0, T), num_rows of them), or null: every row.
  // Listed, only those rows pass through lm_head, so an SFT batch's prompt and image tokens cost
  // no logits: they would add nothing (an ignored row's loss and gradient are zero). token_loss
  // and lse then hold num_rows values in the list's order, and d_hidden is zero on the other rows.
  const int32_t* rows = nullptr;
  int64_t num_rows = 0;
  // The mean is over this many supervised tokens: the global batch's count, known on the host
  // from the packed labels, so that micro-batches and ranks normalise alike (no device sync).
  int64_t num_supervised = 0;
  float d_loss = 1.0f;       // upstream gradient of the mean loss
  int64_t chunk_rows = 1024; // tokens per chunk
  float* token_loss = nullptr;  // [T] f32 written (listed rows: [num_rows])
  float* lse = nullptr;         // [T] f32 written (listed rows: [num_rows])
  float* loss = nullptr;        // [1] f32 written: sum(token_loss) / num_supervised (0 when 0)
  __nv_bfloat16* d_hidden = nullptr;  // [T, H] written, or null (then no backward at all when d_weight is null too)
  float* d_weight = nullptr;          // [V, H] f32 added to, or null
  // d_weight written by the first chunk instead of added to (the caller left it unzeroed: the
  // step's first backward into it); zeroed when no row passes through lm_head.
  bool d_weight_written = false;
  int32_t* bad_label_position = nullptr;  // optional, see cross_entropy_rows_cuda
};

void lm_head_cross_entropy_cuda(GemmContext& ctx, const LmHeadLossArgs& args, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream);

}  // namespace deltamoe
