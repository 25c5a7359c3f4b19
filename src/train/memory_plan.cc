// The memory planner (memory_plan.h): state bytes from the parameter table, model bytes from the
// GPU models' layouts, and the refusal message.
#include "train/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include "core/error.h"
#include "core/units.h"
#include "kernels/cross_entropy/lm_head_loss_workspace.h"
#include "kernels/gated_delta_rule/gated_delta_rule_workspace.h"
#include "kernels/lora/lora_dropout_mask.h"
#include "model/param_table.h"
#include "model/text/text_activations.h"
#include "model/text/text_weights.h"
#include "model/vision/vision_activations.h"
#include "model/vision/vision_weights.h"
#include "model/vision/vision_tower.h"
#include "optim/param_layout.h"
#include "train/parallel_layout.h"

namespace deltamoe {

namespace {

// The runtime's own share: CUDA context and module images beyond what the engine measures at
// start, cuBLAS / cuBLASLt handles and their workspaces, allocator rounding.
constexpr size_t kReserveBytes = size_t{1} << 30;

std::string gib_text(size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f GiB", gib(bytes));
  return text;
}

size_t aligned_elements(int64_t numel) {
  return static_cast<size_t>((numel + kFlatAlignmentElements - 1) / kFlatAlignmentElements * kFlatAlignmentElements);
}

}  // namespace

int64_t planned_max_sequences(const EngineOptions& options) {
  CHECK(options.max_tokens > 0, "train: the engine needs the micro-batch token budget, got ", options.max_tokens);
  if (options.max_samples > 0) return std::min(options.max_samples, options.max_tokens);
  return std::min(options.max_tokens, std::max<int64_t>(64, options.max_tokens / kMinTokensPerSample));
}

int64_t max_image_tokens_in(int64_t tokens, int64_t max_pixels, const VisionConfig& vision) {
  const int64_t side = vision.patch_size * vision.spatial_merge_size;
  if (max_pixels <= 0 || side <= 0) return tokens;
  const int64_t per_image = std::max<int64_t>(max_pixels / (side * side), 1);
  int64_t best = 0;
  for (int64_t images = 1; 3 * images <= tokens; ++images) {
    best = std::max(best, std::min(images * per_image, tokens - 2 * images));
    if (images * per_image >= tokens) break;
  }
  return best;
}

bool master_kept_split(const std::string& name, bool lora, bool read_in_f32) {
  return !lora && !read_in_f32 && is_routed_expert_tensor(name);
}

void plan_state_bytes(const ModelConfig& config, const FreezeOptions& freeze, DType moment_dtype, MemoryPlan* plan,
                      const LoraAdapters* lora, DType expert_grad_dtype) {
  std::set<std::string> read_in_f32 = text_params_read_in_f32(config.text, config.text_prefix());
  if (config.has_vision) {
    for (const std::string& name : vision_params_read_in_f32(config.vision, kVisionPrefix)) read_in_f32.insert(name);
  }
  size_t all = 0, trained = 0, split = 0, frozen_f32 = 0;  // split: trained with a split master (2 bytes)
  std::set<std::string> saved_whole;
  if (lora != nullptr) {
    saved_whole.insert(lora->modules_to_save.begin(), lora->modules_to_save.end());
    for (const LoraTarget& target : lora->targets) {
      // An adapter in the vision tower makes its part run a backward, as a trained tensor there does.
      const ParamGroup group = param_group(target.weight_name());
      plan->vit_trained = plan->vit_trained || group == ParamGroup::vit;
      plan->merger_trained = plan->merger_trained || group == ParamGroup::aligner;
      for (const std::vector<int64_t>& shape : {target.a_shape(lora->options.rank), target.b_shape(lora->options.rank)}) {
        int64_t numel = 1;
        for (int64_t d : shape) numel *= d;
        all += aligned_elements(numel);
        trained += aligned_elements(numel);
      }
    }
  }
  for (const ParamSpec& spec : build_param_table(config)) {
    const size_t numel = aligned_elements(spec.shape.numel());
    all += numel;
    const bool frozen = lora != nullptr ? saved_whole.count(spec.name) == 0 : is_frozen(spec.name, freeze);
    if (!frozen) {
      trained += numel;
      if (master_kept_split(spec.name, lora != nullptr, read_in_f32.count(spec.name) != 0)) split += numel;
      const ParamGroup group = param_group(spec.name);
      plan->vit_trained = plan->vit_trained || group == ParamGroup::vit;
      plan->merger_trained = plan->merger_trained || group == ParamGroup::aligner;
    } else if (read_in_f32.count(spec.name) != 0) {
      frozen_f32 += numel;
    }
  }
  plan->weights = all * 2;
  plan->master = (trained - split) * 4 + split * 2;
  // The split ones (the routed experts) keep bf16 gradients unless told otherwise.
  plan->gradients = (trained - split) * 4 + split * dtype_size(expert_grad_dtype);
  plan->moments = trained * 2 * dtype_size(moment_dtype);
  plan->frozen_f32 = frozen_f32 * 4;
}

ModelBytes estimate_text_bytes(const TextConfig& config, int64_t max_tokens, int64_t max_seqs, int64_t max_image_rows,
                               int64_t loss_chunk_rows, const RecomputeOptions& recompute) {
  TextActivationSpec spec;
  spec.share_mixer_state = recompute.mixers;
  spec.recompute_layers = recompute.full_layers(config.num_hidden_layers);
  spec.keep_expert_rows = recompute.keep_expert_rows;
  spec.keep_gdn_forward = recompute.keep_gdn_forward;
  spec.max_tokens = max_tokens;
  spec.max_seqs = max_seqs;
  spec.max_image_rows = max_image_rows;
  ModelBytes bytes;
  bytes.activations = text_activation_bytes(config, spec);
  bytes.inputs = text_input_bytes(config, spec);
  // The largest kernel workspaces of the step: the routed experts' backward (permuted rows, the
  // gate/up activations), the lm_head chunk's bf16 logits, the gated delta rule's backward.
  const int64_t T = max_tokens, C = config.hidden_size, I = config.moe_intermediate_size;
  const int64_t rows = T * config.num_experts_per_tok;
  const size_t experts = static_cast<size_t>(rows) * static_cast<size_t>(2 * C * 2 + 2 * I * 2 + I * 4 + I * 2);
  // The loss chunk: its bf16 logits, and the gathered supervised rows' hidden states and their gradient.
  const size_t logits = lm_head_cross_entropy_workspace_bytes(std::min(loss_chunk_rows, T), config.vocab_size, C);
  // The GDN backward's workspace (it holds the forward's too) is the kernels' own layout: per token
  // but for the chunk table and the states between chunks inside a sequence, so it hardly grows
  // with the number of sequences (gated_delta_rule_workspace.h).
  const size_t gdn = config.num_layers_of(LayerType::linear_attention) > 0
                         ? gated_delta_rule_workspace_layout(T, max_seqs, config.linear_num_key_heads,
                                                             config.linear_num_value_heads,
                                                             config.linear_key_head_dim,
                                                             config.linear_value_head_dim, true)
                               .total
                         : 0;
  // Full attention through cuDNN's SDPA on sm_90 (kernels/cudnn_sdpa/gpu): the fp32 dQ
  // accumulator and row sums [T, Hq, D + 1], with grouped heads the per-query-head dK and dV [T, Hq,
  // 2 D] at 4 bytes an element, and a 16 MiB allowance for its plans' own scratch (the GPU engine
  // plans what the plans ask).
  const int64_t Hq = config.num_attention_heads, D = config.head_dim;
  const int64_t full_heads = config.num_key_value_heads < Hq ? 2 * D : 0;
  const size_t attention = config.num_layers_of(LayerType::full_attention) > 0
                               ? static_cast<size_t>(4 * T * Hq * (D + 1 + full_heads)) + (size_t{16} << 20)
                               : 0;
  bytes.workspace = std::max({experts, logits, gdn, attention}) + (size_t{32} << 20);  // + cuBLASLt's workspace
  return bytes;
}

size_t estimate_text_lora_bytes(const TextConfig& config, int64_t max_tokens, int64_t rank) {
  if (rank <= 0) return 0;
  auto a256 = [](int64_t bytes) { return static_cast<size_t>((bytes + 255) / 256 * 256); };
  const int64_t T = max_tokens, r = rank, E = config.num_experts, R = T * config.num_experts_per_tok;
  const int64_t C = config.hidden_size, I = config.moe_intermediate_size;
  const size_t dense = 2 * a256(T * r * 2) + 2 * a256(T * 2);
  auto experts = [&](int64_t in, int64_t out) {
    return a256(E * out * r * 2) + 2 * a256(R * r * 2) + a256(R * std::max(in, out) * 4) + a256(E * out * r * 4) +
           a256((E + 1) * 4);
  };
  return dense + std::max(experts(C, 2 * I), experts(I, C));
}

size_t estimate_vision_lora_bytes(int64_t max_patches, int64_t rank) {
  return rank > 0 ? 2 * static_cast<size_t>(max_patches * rank) * 2 : 0;
}

ModelBytes estimate_vision_bytes(const VisionConfig& config, int64_t max_patches, bool vit_trained,
                                 bool merger_trained, int64_t recompute_blocks) {
  VisionActivationSpec spec;
  spec.max_patches = max_patches;
  spec.blocks_backward = vit_trained;
  spec.recompute_blocks = vit_trained ? recompute_blocks : 0;
  spec.any_backward = vit_trained || merger_trained;
  ModelBytes bytes;
  bytes.activations = vision_activation_bytes(config, spec);
  bytes.inputs = vision_input_bytes(config, spec);
  // Column-sum partials of the bias and LayerNorm backwards, attention's lse gradient, or cuDNN's
  // attention on sm_90 (its fp32 dQ accumulator [T, H, D rounded up to 16] and row sums [T, H],
  // and 16 MiB for its plans' scratch), whichever is larger; and cuBLASLt's.
  const int64_t H = config.num_heads, padded_dim = (config.head_dim() + 15) / 16 * 16;
  const size_t partials = static_cast<size_t>(max_patches) * static_cast<size_t>(config.intermediate_size) * 4 / 64;
  const size_t attention = static_cast<size_t>(4 * max_patches * H * (padded_dim + 1)) + (size_t{16} << 20);
  bytes.workspace = std::max(partials, attention) + (size_t{32} << 20);
  return bytes;
}

std::string MemoryPlan::describe() const {
  std::string out;
  auto line = [&](const char* what, size_t bytes, const std::string& note) {
    char row[200];
    std::snprintf(row, sizeof(row), "  %-26s %9.2f GiB%s%s\n", what, gib(bytes), note.empty() ? "" : "  ",
                  note.c_str());
    out += row;
  };
  line("weights (bf16, all)", weights, "");
  line("master (fp32, trained)", master, "");
  line("gradients (fp32, trained)", gradients, "");
  line("Adam moments (trained)", moments, "");
  line("fp32 copies of frozen", frozen_f32, "norms, gates, tables read in fp32");
  if (sharding > 0) line("ZeRO-2 step buffers", sharding, "this rank's reduced gradient pieces");
  line("text activations", text.activations,
       str_cat(max_tokens, " tokens per micro-batch", keep_expert_rows ? ", experts' inputs and gate/up rows kept" : "",
               keep_gdn_forward ? ", GDN forward kept" : ""));
  line("text workspace + inputs", text.workspace + text.inputs, "");
  if (max_patches > 0) {
    line("vision activations", vision.activations,
         str_cat(max_image_tokens, " image tokens (", max_patches, " patches) per micro-batch",
                 vit_trained ? "" : ", ViT frozen: nothing kept for a backward"));
    line("vision workspace + inputs", vision.workspace + vision.inputs, "");
  }
  line("runtime reserve", reserve, "CUDA context, cuBLAS, allocator");
  line("total", total(), "");
  return out;
}

std::string memory_refusal(const MemoryPlan& plan, size_t device_bytes, const EngineOptions& options,
                           const std::string& device_name) {
  if (plan.total() <= device_bytes) return "";
  std::string advice;
  auto add = [&](const std::string& what, size_t saves) {
    if (saves > 0) advice += str_cat("\n  - ", what, " (saves ", gib_text(saves), ")");
  };
  if (options.adamw.moment_dtype == DType::f32) add("--optimizer_state_dtype bf16", plan.moments / 2);
  if (plan.max_tokens > 1024) {
    add(str_cat("--micro_batch_tokens ", plan.max_tokens / 2, " (activations scale with the tokens of a micro-batch)"),
        (plan.text.activations + plan.vision.activations) / 2);
  }
  if (plan.vit_trained || plan.merger_trained) {
    add("--freeze_vit true --freeze_aligner true (the vision tower keeps no gradients, moments or backward state)",
        plan.vision.activations / 2 + (plan.master + plan.gradients + plan.moments) / 10);
  }
  if (plan.max_patches > 0) add("a smaller --max_pixels (fewer image tokens fit in a micro-batch)", plan.vision.activations / 4);
  advice += "\n  - or more GPUs: expert and data parallelism shard the experts and the optimizer state";
  return str_cat("train: the run does not fit on ", device_name, ": it needs ", gib_text(plan.total()), ", ",
                 gib_text(device_bytes), " are available.\nThe plan:\n", plan.describe(), "To fit, change:", advice);
}

MemoryPlan plan_training_memory(const ModelConfig& config, const EngineOptions& options) {
  MemoryPlan plan;
  plan.max_tokens = options.max_tokens;
  plan_state_bytes(config, options.freeze, options.adamw.moment_dtype, &plan, options.lora.get(),
                   options.expert_grad_dtype);
  const int64_t merge = config.vision.spatial_merge_size * config.vision.spatial_merge_size;
  plan.max_image_tokens = config.has_vision ? max_image_tokens_in(options.max_tokens, options.max_image_pixels,
                                                                  config.vision)
                                            : 0;
  plan.max_patches = plan.max_image_tokens * merge;
  plan.text = estimate_text_bytes(config.text, options.max_tokens, planned_max_sequences(options),
                                  plan.max_image_tokens, options.loss_chunk_rows, options.recompute);
  plan.keep_expert_rows = options.recompute.keep_expert_rows;
  plan.keep_gdn_forward = options.recompute.keep_gdn_forward;
  if (plan.max_patches > 0)
    plan.vision = estimate_vision_bytes(config.vision, plan.max_patches, plan.vit_trained, plan.merger_trained,
                                        options.recompute.full_vision_blocks(config.vision.depth));
  if (options.lora != nullptr) {
    const int64_t rank = options.lora->options.rank;
    plan.text.workspace += estimate_text_lora_bytes(config.text, options.max_tokens, rank);
    bool vision_adapters = false;
    for (const LoraTarget& target : options.lora->targets)
      vision_adapters = vision_adapters || param_group(target.weight_name()) != ParamGroup::llm;
    if (plan.max_patches > 0 && vision_adapters)
      plan.vision.workspace += estimate_vision_lora_bytes(plan.max_patches, rank);
    if (options.lora->options.dropout > 0) {
      // Dropping adapters: x' and the masked input gradient, [rows, widest input] fp32 (as the GPU
      // models' enable_lora_dropout allocates).
      const int64_t text_in = lora_dense_max_in_features(options.lora->targets, false);
      const int64_t vision_in = lora_dense_max_in_features(options.lora->targets, true);
      if (text_in > 0) plan.text.workspace += lora_dropout_scratch_bytes(options.max_tokens, text_in);
      if (plan.max_patches > 0 && vision_in > 0)
        plan.vision.workspace += lora_dropout_scratch_bytes(plan.max_patches, vision_in);
    }
  }
  plan.reserve = kReserveBytes;
  return plan;
}

}  // namespace deltamoe
