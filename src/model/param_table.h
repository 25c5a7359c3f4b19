// The parameter table: every tensor of a Qwen3.5-MoE model with its Hugging Face name, shape,
// dtype on disk and component, in the FUSED in-memory expert layout. The one place where
// HF names live; checkpoint loading/saving and the trainer both walk this table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "model/config.h"

namespace deltamoe {

// Groups for parameter counts (deltamoe inspect) and for per-group training choices.
enum class Component {
  embedding,       // embed_tokens and lm_head
  gdn,             // linear_attn.* of Gated DeltaNet layers
  attention,       // self_attn.* of full-attention layers
  routed_experts,  // mlp.experts.gate_up_proj / down_proj
  router_shared,   // mlp.gate, shared_expert.*, shared_expert_gate
  norm,            // input/post-attention layernorms and the final norm
  vision,          // model.visual.*
};
const char* component_name(Component component);
constexpr int kNumComponents = 7;

// How a parameter is initialised from scratch (transformers' _init_weights; see random_init).
enum class InitKind {
  normal,  // normal(0, initializer_range): Linear/Conv/Embedding weights, router, fused experts
  zeros,   // biases and zero-centred RMSNorm weights ((1 + w) scaling)
  ones,    // LayerNorm weights and the plain gated RMSNorm weight (linear_attn.norm)
  a_log,   // log(U(0.01, 16)) (GDN A_log)
};

struct ParamSpec {
  std::string name;       // HF key, e.g. "model.language_model.layers.0.linear_attn.A_log"
  Shape shape;            // torch order, [out, in] for Linear
  DType dtype;            // dtype on disk for a model of `dtype` (A_log stays f32 as in the released checkpoints)
  bool trainable = true;  // every parameter trains in full fine-tuning; freezing is the trainer's choice
  Component component;
  InitKind init = InitKind::normal;
  int layer_idx = -1;  // decoder layer (or vision block) index; -1 for global tensors
};

// All parameters of `config` in a fixed order (embeddings, layers in order, final norm, lm_head,
// vision tower). `dtype` is the model dtype (bf16 or f32); A_log is always f32.
std::vector<ParamSpec> build_param_table(const ModelConfig& config, DType dtype = DType::bf16);
// The text tower's part: `prefix` is its key prefix ("model" for qwen3_5_moe_text,
// "model.language_model" for qwen3_5_moe); lm_head.weight has no prefix. Per layer: the two norms,
// the mixer (GDN or attention), the MoE block.
std::vector<ParamSpec> text_param_table(const TextConfig& text, const std::string& prefix, bool with_lm_head,
                                        DType dtype = DType::bf16);
// The vision tower's part (prefix "model.visual").
std::vector<ParamSpec> vision_param_table(const VisionConfig& vision, const std::string& prefix,
                                          DType dtype = DType::bf16);

// Names of the fused routed-expert tensors of decoder layer `layer_idx`.
std::string fused_gate_up_name(const ModelConfig& config, int layer_idx);  // [E, 2I, H]
std::string fused_down_name(const ModelConfig& config, int layer_idx);     // [E, H, I]
// Per-expert names (what transformers 5.17 save_pretrained writes); part is gate_proj/up_proj/down_proj.
std::string per_expert_name(const ModelConfig& config, int layer_idx, int64_t expert_idx, const char* part);

struct ParamCounts {
  int64_t total = 0;                          // all parameters in the table (no mtp.*)
  int64_t by_component[kNumComponents] = {};  // indexed by Component
  int64_t text_total = 0;                     // total minus vision
  // Parameters one text token passes through: everything of the text tower except embed_tokens
  // (a lookup), routed experts scaled by k/E. lm_head counts (it is a matmul per token).
  int64_t active_per_token = 0;
  int64_t active_per_token_with_embedding = 0;  // the same plus the whole embed_tokens table
};
ParamCounts count_params(const ModelConfig& config);

}  // namespace deltamoe
