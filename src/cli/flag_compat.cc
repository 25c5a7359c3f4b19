// The table of other tools' flags (see flag_compat.h). Each reason is one line: what the flag does
// there, why deltamoe needs nothing or cannot do it, and what to write instead.
#include "cli/flag_compat.h"

namespace deltamoe {
namespace {

using Action = ForeignFlag::Action;

ForeignFlag alias(const char* name, const char* target, ArgKind kind) {
  return ForeignFlag{name, Action::kAlias, kind, target, "", {}, ""};
}

ForeignFlag no_effect(const char* name, ArgKind kind, const char* reason, std::vector<std::string> harmless = {},
                      const char* refused_reason = "") {
  return ForeignFlag{name, Action::kNoEffect, kind, "", reason, std::move(harmless), refused_reason};
}

ForeignFlag refused(const char* name, ArgKind kind, const char* reason) {
  return ForeignFlag{name, Action::kRefused, kind, "", reason, {}, ""};
}

constexpr ArgKind kText = ArgKind::kText;
constexpr ArgKind kInt = ArgKind::kInteger;
constexpr ArgKind kNumber = ArgKind::kNumber;
constexpr ArgKind kBool = ArgKind::kBool;
constexpr ArgKind kList = ArgKind::kList;

const char* const kNoModelSplit =
    "deltamoe splits work over ranks only with --expert_model_parallel_size and --use_distributed_optimizer "
    "(docs/parallel.md); give 1 or leave it out";
const char* const kLoraSetting = "a LoRA setting of `deltamoe train --tuner_type lora` (docs/lora.md)";
const char* const kLoraVariant =
    "not part of deltamoe's LoRA (plain PEFT LoRA on --target_modules / --target_parameters, docs/lora.md); drop it";
const char* const kFalseRefused = "deltamoe always does this; leave the flag out";
const char* const kBf16Training = "weights train in bf16 with fp32 master weights and moments";
const char* const kBf16Only = "deltamoe trains in bf16 (fp32 master weights); give bfloat16 or leave it out";
const char* const kOwnAttention = "attention runs cuDNN's fused SDPA on Hopper and deltamoe's own kernels elsewhere";
const char* const kOwnRecompute = "deltamoe chooses what to recompute itself";
const char* const kPackedSamples = "samples are always packed without padding; each keeps its own positions and loss";

std::vector<ForeignFlag> make_table() {
  return {
      // --- the same meaning under another name ---
      alias("learning_rate", "lr", kNumber),
      alias("train_type", "tuner_type", kText),
      alias("per_device_train_batch_size", "micro_batch_size", kInt),
      alias("resume_from_checkpoint", "resume", kText),
      alias("moe_aux_loss_coeff", "router_aux_loss_coef", kNumber),
      alias("lr_warmup_fraction", "warmup_ratio", kNumber),
      alias("lr_warmup_iters", "warmup_steps", kInt),
      alias("train_iters", "max_steps", kInt),
      alias("max_epochs", "num_train_epochs", kInt),
      alias("clip_grad", "max_grad_norm", kNumber),
      alias("adam_eps", "adam_epsilon", kNumber),
      alias("save_interval", "save_steps", kInt),
      alias("eval_interval", "eval_steps", kInt),
      alias("log_interval", "logging_steps", kInt),
      alias("num_workers", "dataloader_num_workers", kInt),
      alias("no_save_optim", "save_only_model", kBool),
      alias("data_seed", "seed", kInt),
      alias("chat_template", "template", kText),

      // --- change nothing here (noted once at the start) ---
      no_effect("torch_dtype", kText, kBf16Training, {"bfloat16", "bf16"}, kBf16Only),
      no_effect("dtype", kText, kBf16Training, {"bfloat16", "bf16"}, kBf16Only),
      no_effect("bf16", kBool, "bf16 is how deltamoe trains", {"true", "True", "1"},
                "deltamoe trains in bf16; leave the flag out"),
      no_effect("fp16", kBool, "deltamoe trains in bf16", {"false", "False", "0"},
                "fp16 training is not supported: deltamoe trains in bf16 (fp32 master weights)"),
      no_effect("tf32", kBool, "fp32 GEMMs are not used in the training step"),
      no_effect("load_from_cache_file", kBool, "no dataset cache: lines are read and tokenized while training"),
      no_effect("dataset_num_proc", kInt, "samples are prepared by --dataloader_num_workers threads while training"),
      no_effect("lazy_tokenize", kBool, "samples are always tokenized as they are needed"),
      no_effect("streaming", kBool, "dataset files are indexed once and read line by line"),
      no_effect("per_device_eval_batch_size", kInt,
                "evaluation runs the same packed micro-batches as training; the loss does not depend on it"),
      no_effect("experts_impl", kText, "the MoE experts run deltamoe's own grouped GEMM"),
      no_effect("attn_impl", kText, kOwnAttention),
      no_effect("attn_implementation", kText, kOwnAttention),
      no_effect("attention_backend", kText, kOwnAttention),
      no_effect("use_flash_attn", kBool, kOwnAttention),
      no_effect("group_by_length", kBool,
                "samples are packed without padding, which is what grouping by length is for; the order stays the "
                "seeded shuffle"),
      no_effect("packing", kBool, kPackedSamples),
      no_effect("padding_free", kBool, kPackedSamples),
      no_effect("deepspeed", kText, "deltamoe places its training state itself; ZeRO stages change memory, not results"),
      no_effect("fsdp", kText, "deltamoe places its training state itself; sharding changes memory, not results"),
      no_effect("gradient_checkpointing", kBool, kOwnRecompute),
      no_effect("vit_gradient_checkpointing", kBool, kOwnRecompute),
      no_effect("gradient_checkpointing_kwargs", kText, kOwnRecompute),
      no_effect("recompute_modules", kList, kOwnRecompute),
      no_effect("use_liger_kernel", kBool, "the loss is deltamoe's fused lm_head + cross-entropy"),
      no_effect("cross_entropy_loss_fusion", kBool, "the loss is deltamoe's fused lm_head + cross-entropy"),
      no_effect("moe_permute_fusion", kBool, "the MoE dispatch is deltamoe's own"),
      no_effect("moe_grouped_gemm", kBool, "the MoE experts run deltamoe's own grouped GEMM"),
      no_effect("moe_shared_expert_overlap", kBool, "the MoE block is deltamoe's own"),
      no_effect("moe_token_dispatcher_type", kText, "the MoE dispatch is deltamoe's own"),
      no_effect("moe_router_dtype", kText, "the router runs in fp32", {"fp32", "float32"},
                "the router runs in fp32 in deltamoe; give fp32 or leave it out"),
      no_effect("masked_softmax_fusion", kBool, "deltamoe's own kernels"),
      no_effect("bias_swiglu_fusion", kBool, "deltamoe's own kernels"),
      no_effect("apply_rope_fusion", kBool, "deltamoe's own kernels"),
      no_effect("gradient_accumulation_fusion", kBool,
                "gradients accumulate by fp32 adds either way (the routed experts' kept per --expert_grad_dtype)"),
      no_effect("sequence_parallel", kBool, "it only matters with tensor parallelism"),
      no_effect("overlap_grad_reduce", kBool,
                "on several ranks the gradients are reduce-scattered as each backward phase ends, on the "
                "compute stream"),
      no_effect("overlap_param_gather", kBool,
                "each rank updates its shard and the weights are gathered after the step"),
      no_effect("optimizer_cpu_offload", kBool, "deltamoe places its optimizer state itself"),
      no_effect("optimizer_offload_fraction", kNumber, "deltamoe places its optimizer state itself"),
      no_effect("use_precision_aware_optimizer", kBool,
                "the moments' precision is --optimizer_state_dtype (f32 by default)"),
      no_effect("finetune", kBool, "training always starts from the --model weights", {"true", "True", "1"},
                "deltamoe always starts from the --model weights; continue a run with --resume"),
      no_effect("no_save_rng", kBool, "the trainer's random state is a few bytes of trainer_state.json"),
      no_effect("save_safetensors", kBool, "checkpoints are always safetensors", {"true", "True", "1"},
                "deltamoe writes safetensors only"),
      no_effect("load_safetensors", kBool, "model directories are read as safetensors", {"true", "True", "1"},
                "deltamoe reads safetensors only"),
      no_effect("use_hf", kBool, "models are local directories or found in the local HF / ModelScope caches"),
      no_effect("model_type", kText, "the architecture is read from MODEL/config.json"),
      no_effect("model_author", kText, "only ms-swift's self-cognition dataset uses it, which deltamoe does not load"),
      no_effect("model_name", kList, "only ms-swift's self-cognition dataset uses it, which deltamoe does not load"),
      no_effect("dataloader_pin_memory", kBool, "batches are staged by the engine"),
      no_effect("dataloader_persistent_workers", kBool, "the loader threads live for the whole run"),
      no_effect("ddp_backend", kText,
                "ranks exchange data over NCCL on GPUs (TCP on the CPU engine) beside deltamoe's own control plane"),
      no_effect("ddp_timeout", kInt, "a rank silent for DELTAMOE_COMM_TIMEOUT seconds (default 30) ends the job"),
      no_effect("local_rank", kInt, "ranks are set by deltamoe launch / torchrun's variables"),
      no_effect("full_determinism", kBool, "deltamoe's runs are deterministic for a seed"),
      no_effect("logging_first_step", kBool, "the first step is always printed"),
      no_effect("eval_on_start", kBool, "with --val_dataset the run always evaluates at the start"),
      no_effect("enable_thinking", kBool, "it only changes the generation prompt at inference"),
      no_effect("max_new_tokens", kInt, "training generates nothing"),
      no_effect("temperature", kNumber, "training generates nothing"),
      no_effect("check_model", kBool, "the model directory is always checked when it is loaded"),
      no_effect("remove_unused_columns", kBool, "only the known fields of a dataset line are read"),
      no_effect("save_on_each_node", kBool, "one node"),
      no_effect("torch_empty_cache_steps", kInt, "deltamoe plans its GPU memory once"),
      no_effect("use_chat_template", kBool, "samples are rendered with the chat template", {"true", "True", "1"},
                "deltamoe always renders samples with the chat template"),
      no_effect("dataset_shuffle", kBool, "the data is shuffled with --seed", {"true", "True", "1"},
                "deltamoe always shuffles the training data with --seed"),
      no_effect("loss_scale", kText,
                "every assistant turn is trained and the empty <think> block is not (ms-swift's ignore_empty_think)",
                {"ignore_empty_think", "default+ignore_empty_think"},
                "deltamoe trains every assistant turn except the empty <think> block (ignore_empty_think); other "
                "loss scales are not supported"),
      no_effect("lr_scheduler_type", kText, "the schedule is linear warmup then cosine from --lr to --min_lr",
                {"cosine", "cosine_with_min_lr"},
                "deltamoe's schedule is linear warmup then cosine from --lr to --min_lr"),
      no_effect("lr_decay_style", kText, "the schedule is linear warmup then cosine from --lr to --min_lr", {"cosine"},
                "deltamoe's schedule is linear warmup then cosine from --lr to --min_lr"),
      no_effect("optim", kText, "the optimizer is AdamW with decoupled weight decay",
                {"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw"},
                "deltamoe's optimizer is AdamW (--adam_beta1/2, --adam_epsilon, --weight_decay)"),
      no_effect("optimizer", kText, "the optimizer is AdamW with decoupled weight decay", {"adam", "adamw"},
                "deltamoe's optimizer is AdamW (--adam_beta1/2, --adam_epsilon, --weight_decay)"),
      no_effect("save_strategy", kText, "checkpoints are saved every --save_steps and at the end", {"steps"},
                "deltamoe saves every --save_steps and at the end"),
      no_effect("eval_strategy", kText, "with --val_dataset the run evaluates every --eval_steps", {"steps"},
                "deltamoe evaluates at the start, every --eval_steps and at the end; leave out --val_dataset for none"),
      no_effect("evaluation_strategy", kText, "with --val_dataset the run evaluates every --eval_steps", {"steps"},
                "deltamoe evaluates at the start, every --eval_steps and at the end; leave out --val_dataset for none"),
      no_effect("logging_strategy", kText, "the progress line is printed every --logging_steps", {"steps"},
                "deltamoe logs every --logging_steps"),
      no_effect("ignore_data_skip", kBool, "a resumed run continues at the exact sample", {"false", "False", "0"},
                "a resumed run always continues at the exact sample where the checkpoint was saved"),
      no_effect("tensor_model_parallel_size", kInt, "no split of layers, heads or sequences", {"1"}, kNoModelSplit),
      no_effect("pipeline_model_parallel_size", kInt, "no split of layers, heads or sequences", {"1"}, kNoModelSplit),
      no_effect("expert_tensor_parallel_size", kInt, "no split of layers, heads or sequences", {"1"}, kNoModelSplit),
      no_effect("context_parallel_size", kInt, "no split of layers, heads or sequences", {"1"}, kNoModelSplit),
      no_effect("sequence_parallel_size", kInt, "no split of layers, heads or sequences", {"1"}, kNoModelSplit),
      no_effect("mtp_num_layers", kInt, "the mtp.* tensors are carried through every save unchanged", {"0"},
                "the multi-token-prediction layers are not trained: deltamoe carries the mtp.* tensors through every "
                "save unchanged; leave the flag out"),

      // --- cannot be honoured: the reason and the deltamoe way ---
      // LoRA: `deltamoe train`'s own flags (its own flag wins); elsewhere (deltamoe data) they change nothing.
      no_effect("lora_rank", kInt, kLoraSetting),
      no_effect("lora_alpha", kNumber, kLoraSetting),
      no_effect("lora_dropout", kNumber, kLoraSetting),
      no_effect("lora_dtype", kText, kLoraSetting),
      no_effect("use_rslora", kBool, kLoraSetting),
      no_effect("target_modules", kList, kLoraSetting),
      no_effect("target_parameters", kList, kLoraSetting),
      no_effect("modules_to_save", kList, kLoraSetting),
      refused("lora_bias", kText, kLoraVariant),
      refused("target_regex", kText, "give the module names (or all-linear) to --target_modules; regular expressions "
              "are not supported"),
      refused("use_dora", kBool, kLoraVariant),
      refused("init_weights", kText, "adapters start as PEFT's default (A Kaiming-uniform, B zero); drop the flag"),
      refused("merge_lora", kBool, "merging is a separate step: deltamoe export --adapters CHECKPOINT --merge_lora true "
              "--output_dir DIR"),
      refused("adapters", kList, "training on top of saved adapters is not supported; --resume continues a LoRA run, "
              "deltamoe export --adapters merges one"),
      refused("quant_bits", kInt, "quantized training is not supported: deltamoe trains bf16 weights"),
      refused("quant_method", kText, "quantized training is not supported: deltamoe trains bf16 weights"),
      refused("decoder_first_pipeline_num_layers", kInt, kNoModelSplit),
      refused("decoder_last_pipeline_num_layers", kInt, kNoModelSplit),
      refused("moe_expert_capacity_factor", kNumber,
              "deltamoe never drops tokens (no expert capacity), so a capacity factor would change what is trained; "
              "leave it out"),
      refused("no_load_optim", kBool, "a resumed run always restores the optimizer state (use --resume)"),
      refused("no_load_rng", kBool, "a resumed run always restores its random state (use --resume)"),
      refused("vit_lr", kNumber, "one learning rate (--lr) for every trained tensor; freeze parts with --freeze_vit"),
      refused("aligner_lr", kNumber, "one learning rate (--lr) for every trained tensor; freeze parts with --freeze_aligner"),
      refused("system", kText, "a default system prompt is not supported; put a system message in the data"),
      refused("columns", kText, "column renaming is not supported; deltamoe reads messages, ShareGPT, alpaca and "
                                "query/response lines (docs/data.md)"),
      refused("custom_dataset_info", kText, "give the dataset files themselves to --dataset"),
      refused("external_plugins", kList, "plugins are not supported"),
      refused("neftune_noise_alpha", kNumber, "NEFTune noise is not supported"),
      refused("enable_channel_loss", kBool, "per-channel losses are not supported"),
      refused("load_best_model_at_end", kBool, "the last checkpoint is the result; pick another by its val_loss in "
                                               "metrics.jsonl"),
      refused("metric_for_best_model", kText, "the last checkpoint is the result; pick another by its val_loss in "
                                              "metrics.jsonl"),
      refused("predict_with_generate", kBool, "evaluation computes the validation loss and token accuracy only"),
      refused("create_checkpoint_symlink", kBool, "not written; --resume auto finds the newest checkpoint"),
      refused("vit_lora", kBool, "--target_modules all-linear already adapts the vision tower's Linear layers, as "
              "PEFT does; name modules to choose"),
      refused("packing_length", kInt, "the packing budget is --micro_batch_tokens (or --micro_batch_size samples)"),
  };
}

}  // namespace

const std::vector<ForeignFlag>& foreign_flag_table() {
  static const std::vector<ForeignFlag> table = make_table();
  return table;
}

void add_foreign_flags(ArgParser& parser) {
  for (const ForeignFlag& flag : foreign_flag_table()) {
    if (flag.action == ForeignFlag::Action::kAlias && !parser.declares(flag.target)) continue;
    if (parser.declares(flag.name)) continue;  // the command has a flag of that name itself
    parser.add_foreign(flag);
  }
}

}  // namespace deltamoe
