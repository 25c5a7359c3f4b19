// LoRA adapters as PEFT defines them (LoraConfig, lora.Linear, lora.ParamWrapper): which weights of a
// Qwen3.5-MoE model get one (target_modules, "all-linear", target_parameters), their shapes, PEFT's
// initialisation, the scaling, the adapter's contribution to a weight (for merging and for the fused
// kernels), and the names PEFT saves them under.
//
// In the fp32 parameter maps of the CPU model an adapter of weight module M is three entries next to
// M's own: M.lora_A.weight, M.lora_B.weight (trained), M.lora_scaling (one value, never trained) and,
// with --lora_dropout > 0, M.lora_index (the target's index, which keys its dropout mask).
// For a routed-expert weight M is the fused parameter itself (e.g. "...mlp.experts.gate_up_proj").
// Shapes (r rank, E experts): Linear weight [out, in]: A [r, in], B [out, r], delta = s B A.
// Fused expert weight [E, out, in] (each expert's weight in torch's Linear order, as PEFT 0.21's
// ParamWrapper reads it): A [r E, in] (rows e r + j), B [out, r E] (columns j E + e), and
// delta[e] = s B_e A_e with A_e[j, i] = A[e r + j, i], B_e[o, j] = B[o, j E + e] (checked against
// PEFT 0.21's merge_and_unload in lora_golden_test).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace deltamoe {

// ms-swift / PEFT LoRA settings (ms-swift's flag names).
struct LoraOptions {
  int64_t rank = 8;                                      // --lora_rank
  double alpha = 32;                                     // --lora_alpha
  double dropout = 0;                                    // --lora_dropout, in [0, 1) (not with target_parameters)
  bool use_rslora = false;                               // --use_rslora: scaling alpha / sqrt(r)
  std::vector<std::string> target_modules{"all-linear"};  // --target_modules
  std::vector<std::string> target_parameters;            // --target_parameters (fused 3-D expert weights)
  std::vector<std::string> modules_to_save;              // --modules_to_save (trained whole)
  std::string dtype = "float32";                         // --lora_dtype (adapters are kept in fp32)

  double scaling() const;
  // Throws with the flag's name when a value is out of range or not supported.
  void validate() const;
};

// One weight that carries an adapter.
struct LoraTarget {
  std::string module;        // Linear: its module name; experts: the fused parameter's name
  bool experts = false;      // a fused [E, out, in] routed-expert weight (PEFT target_parameters)
  int64_t num_experts = 1;   // E (1 for a Linear)
  int64_t in_features = 0;   // Linear: in; experts: dimension 2 of the parameter
  int64_t out_features = 0;  // Linear: out; experts: dimension 1
  bool has_bias = false;     // Linear with a bias (vision tower)

  std::string weight_name() const { return experts ? module : module + ".weight"; }
  std::string a_name() const { return module + ".lora_A.weight"; }
  std::string b_name() const { return module + ".lora_B.weight"; }
  std::string scaling_name() const { return module + ".lora_scaling"; }
  std::string index_name() const { return module + ".lora_index"; }  // with dropout: the mask's adapter index
  std::vector<int64_t> a_shape(int64_t rank) const { return {rank * num_experts, in_features}; }
  std::vector<int64_t> b_shape(int64_t rank) const { return {out_features, rank * num_experts}; }
};

// Every module of the model that transformers builds as nn.Linear (lm_head included), in the order of
// the parameter table: GDN in_proj_qkv/z/b/a and out_proj, attention q/k/v/o_proj, shared_expert
// gate/up/down_proj, shared_expert_gate, vision attn.qkv/proj, mlp.linear_fc1/fc2 and the merger's
// linear_fc1/fc2. Not Linear there (never a LoRA target): the router mlp.gate (Qwen3_5MoeTopKRouter holds an
// nn.Parameter), the fused experts (nn.Parameter), conv1d (Conv1d), patch_embed.proj (Conv3d),
// embed_tokens and pos_embed (Embedding), the norms.
std::vector<LoraTarget> linear_modules(const ModelConfig& config);

// The adapted weights of options, as PEFT resolves them on the transformers model: "all-linear" is
// every linear_modules() entry except lm_head (the output embedding); another entry of
// target_modules names the modules equal to it or ending in "." + it; target_parameters entries
// name fused expert parameters the same way. Throws naming the entry when one matches no module
// (or matches a module that is not a Linear), as PEFT does.
std::vector<LoraTarget> resolve_lora_targets(const ModelConfig& config, const LoraOptions& options);

// The parameter names trained whole because their module is in options.modules_to_save (matched
// like target_modules, over every module of the model); throws naming an entry that matches none.
std::vector<std::string> resolve_modules_to_save(const ModelConfig& config, const LoraOptions& options);

// The widest input of the dense (non-expert) targets in the vision tower (vision true: modules under
// "model.visual.") or in the text model: what one row of a dropping adapter's GPU scratch holds.
int64_t lora_dense_max_in_features(const std::vector<LoraTarget>& targets, bool vision);

// PEFT's initialisation of A, seeded (one Philox stream per target): Kaiming-uniform with a = sqrt(5),
// i.e. uniform in +-1/sqrt(in_features). B starts at zero.
void init_lora_a(const LoraTarget& target, int64_t rank, uint64_t seed, uint64_t stream, std::vector<float>* a);

// delta (target's weight shape) = the adapter's contribution, overwritten.
template <typename T>
void lora_delta(const LoraTarget& target, int64_t rank, const T* a, const T* b, double scaling, T* delta);
// From the gradient of the adapted weight: dA and dB added to.
template <typename T>
void lora_delta_backward(const LoraTarget& target, int64_t rank, const T* a, const T* b, double scaling,
                         const T* d_weight, T* d_a, T* d_b);

// The key PEFT's save_pretrained gives an adapter tensor (A_or_B "lora_A" or "lora_B"):
// "base_model.model.<module>.lora_A.weight"; for a fused expert weight the module is the experts
// block, wrapped once per targeted parameter in the order transformers registers them (gate_up_proj,
// then down_proj): the inner wrapper's keys carry ".base_layer".
std::string peft_adapter_key(const LoraTarget& target, const std::vector<LoraTarget>& all_targets,
                             const std::string& a_or_b);
// "base_model.model.<name>" (modules_to_save tensors and the prefix of every key).
std::string peft_model_key(const std::string& name);

}  // namespace deltamoe
