// `deltamoe parity`: runs the CPU fp32 reference (or, with --device cuda, the GPU engine) on one
// batch (images too) and writes losses, logits and every trainable parameter's gradient (ce and aux
// separately, frozen parts left out) to safetensors, for comparison with transformers.
#include <cstdio>

#include "checkpoint/model_checkpoint.h"
#include "checkpoint/peft_adapter.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "train/parity.h"
#if DELTAMOE_WITH_CUDA
#include "train/gpu/gpu_parity.h"
#endif

namespace deltamoe {

int cmd_parity(int argc, char** argv) {
  ArgParser args("parity", "forward + backward of the reference model on one batch; writes losses, logits, gradients");
  args.add_required("model", "model directory (config.json + safetensors, either expert layout)");
  args.add_required("inputs",
                    "safetensors with input_ids, labels [B, S] (int64), optional cu_seqlens (int32, B = 1); images: "
                    "pixel_values [N, 1536] (f32), image_grid_thw [I, 3] (int64), optional mm_token_type_ids [B, S]");
  args.add_required("out", "output safetensors: ce_loss, aux_loss, logits, grad.<name>, grad_aux.<name> (f32)");
  args.add_option("device", "where to run: cpu (the fp32 reference) or cuda (the GPU engine, bf16; CUDA builds)",
                  "cpu");
  args.add_option("adapters", "a PEFT LoRA adapter directory (deltamoe's or PEFT's): applied to the model, and the "
                  "gradients written are the adapters' (PEFT key names); cpu only", "");
  args.add_flag("freeze_vit", "no gradients for the vision tower (model.visual.* except the merger)");
  args.add_flag("freeze_aligner", "no gradients for the vision merger (model.visual.merger.*)");
  args.add_flag("freeze_llm", "no gradients for the language model (embed_tokens and lm_head included)");
  if (!args.parse(argc, argv)) return 0;
  const std::string device = args.get("device");
  CHECK(device == "cpu" || device == "cuda", "parity: --device ", device,
        " is not a device; use --device cpu (the fp32 reference) or --device cuda (the GPU engine)");
#if !DELTAMOE_WITH_CUDA
  CHECK(device == "cpu", "parity: --device cuda needs a deltamoe built with CUDA (this one was built without: ",
        "configure with -DDELTAMOE_CUDA=ON); use --device cpu here");
#endif
  const ModelCheckpoint checkpoint = load_model_dir(args.get("model"));
  const ParityInputs inputs = load_parity_inputs(args.get("inputs"));
  TrainableParts trainable;
  trainable.vit = !args.flag("freeze_vit");
  trainable.aligner = !args.flag("freeze_aligner");
  trainable.llm = !args.flag("freeze_llm");
  if (!args.get("adapters").empty()) {
    CHECK(device == "cpu", "parity: --adapters runs on the CPU reference only (the GPU engine has no LoRA kernels yet)");
    const LoraAdapters lora = load_peft_adapter(args.get("adapters"), checkpoint.config);
    const ParityResult result = run_parity_cpu(checkpoint, inputs, trainable, &lora);
    write_parity_outputs(args.get("out"), result);
    std::printf("ce_loss %.9g aux_loss %.9g, %zu adapter gradients per loss written to %s (cpu)\n", result.ce_loss,
                result.aux_loss, result.grads.size(), args.get("out").c_str());
    return 0;
  }
#if DELTAMOE_WITH_CUDA
  const ParityResult result =
      device == "cuda" ? run_parity_gpu(checkpoint, inputs, trainable) : run_parity_cpu(checkpoint, inputs, trainable);
#else
  const ParityResult result = run_parity_cpu(checkpoint, inputs, trainable);
#endif
  write_parity_outputs(args.get("out"), result);
  std::printf("ce_loss %.9g aux_loss %.9g, %zu gradients per loss written to %s (%s)\n", result.ce_loss,
              result.aux_loss, result.grads.size(), args.get("out").c_str(), device.c_str());
  return 0;
}

}  // namespace deltamoe
