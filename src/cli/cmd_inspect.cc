// `deltamoe inspect`: a config summary, parameter counts (total, active per token, per component),
// an optional per-tensor listing, and for a checkpoint directory a completeness check (exit 1 when
// tensors are missing, unexpected or of the wrong shape).
#include <cstdio>
#include <map>
#include <string>

#include "checkpoint/model_checkpoint.h"
#include "checkpoint/sharded.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "model/config.h"
#include "model/param_table.h"

namespace deltamoe {
namespace {

// 35107181936 -> "35,107,181,936".
std::string with_commas(int64_t value) {
  std::string digits = std::to_string(value < 0 ? -value : value), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return value < 0 ? "-" + out : out;
}

std::string human(int64_t value) {
  char text[32];
  if (value >= 1'000'000'000) {
    std::snprintf(text, sizeof(text), "%.2f B", value / 1e9);
  } else if (value >= 1'000'000) {
    std::snprintf(text, sizeof(text), "%.2f M", value / 1e6);
  } else {
    std::snprintf(text, sizeof(text), "%.1f K", value / 1e3);
  }
  return text;
}

void print_summary(const ModelConfig& config) {
  const TextConfig& t = config.text;
  std::printf("model_type        %s (%s)\n", config.model_type.c_str(),
              config.has_vision ? "vision-language" : "text only");
  std::printf("text              hidden %lld, %lld layers (%lld GDN + %lld full attention), vocab %lld\n",
              (long long)t.hidden_size, (long long)t.num_hidden_layers,
              (long long)t.num_layers_of(LayerType::linear_attention),
              (long long)t.num_layers_of(LayerType::full_attention), (long long)t.vocab_size);
  std::printf("attention         Nq %lld, Nkv %lld, head_dim %lld, rotary_dim %lld, mrope [%lld,%lld,%lld], theta %g\n",
              (long long)t.num_attention_heads, (long long)t.num_key_value_heads, (long long)t.head_dim,
              (long long)t.rotary_dim(), (long long)t.mrope_section[0], (long long)t.mrope_section[1],
              (long long)t.mrope_section[2], t.rope_theta);
  std::printf("gated deltanet    Hk %lld, Hv %lld, Dk %lld, Dv %lld, conv %lld\n", (long long)t.linear_num_key_heads,
              (long long)t.linear_num_value_heads, (long long)t.linear_key_head_dim, (long long)t.linear_value_head_dim,
              (long long)t.linear_conv_kernel_dim);
  std::printf("moe               E %lld, top-k %lld, I %lld, shared Is %lld\n", (long long)t.num_experts,
              (long long)t.num_experts_per_tok, (long long)t.moe_intermediate_size,
              (long long)t.shared_expert_intermediate_size);
  if (config.has_vision) {
    const VisionConfig& v = config.vision;
    std::printf(
        "vision            depth %lld, hidden %lld, heads %lld, mlp %lld, patch %lld, temporal %lld, merge %lld, "
        "out %lld, pos %lld\n",
        (long long)v.depth, (long long)v.hidden_size, (long long)v.num_heads, (long long)v.intermediate_size,
        (long long)v.patch_size, (long long)v.temporal_patch_size, (long long)v.spatial_merge_size,
        (long long)v.out_hidden_size, (long long)v.num_position_embeddings);
    std::printf("special tokens    image %lld, video %lld, vision_start %lld, vision_end %lld\n",
                (long long)config.image_token_id, (long long)config.video_token_id,
                (long long)config.vision_start_token_id, (long long)config.vision_end_token_id);
  }
}

void print_counts(const ModelConfig& config) {
  ParamCounts counts = count_params(config);
  std::printf("\nparameters (without mtp.*)\n");
  for (int c = 0; c < kNumComponents; ++c) {
    if (!config.has_vision && static_cast<Component>(c) == Component::vision) continue;
    std::printf("  %-16s %20s  (%s)\n", component_name(static_cast<Component>(c)),
                with_commas(counts.by_component[c]).c_str(), human(counts.by_component[c]).c_str());
  }
  std::printf("  %-16s %20s  (%s)\n", "total", with_commas(counts.total).c_str(), human(counts.total).c_str());
  std::printf("  %-16s %20s  (%s)\n", "text total", with_commas(counts.text_total).c_str(),
              human(counts.text_total).c_str());
  std::printf("  %-16s %20s  (%s; routed experts x %lld/%lld, embed_tokens lookup excluded)\n", "active/token",
              with_commas(counts.active_per_token).c_str(), human(counts.active_per_token).c_str(),
              (long long)config.text.num_experts_per_tok, (long long)config.text.num_experts);
  std::printf("  %-16s %20s  (%s)\n", "active+embed", with_commas(counts.active_per_token_with_embedding).c_str(),
              human(counts.active_per_token_with_embedding).c_str());
}

}  // namespace

int cmd_inspect(int argc, char** argv) {
  ArgParser args("inspect", "summarise a model config or check a checkpoint directory");
  args.add_positional("dir", "checkpoint directory (config.json + safetensors) to check", false);
  args.add_option("config", "a preset or config.json to summarise instead of a directory", "");
  args.add_flag("tensors", "list every tensor (name, shape, dtype, trainable, component)");
  if (!args.parse(argc, argv)) return 0;
  const bool have_dir = args.has("dir") && !args.get("dir").empty();
  const std::string config_arg = args.get("config");
  CHECK(have_dir != !config_arg.empty(), "give either a checkpoint directory or --config PRESET|config.json\n",
        args.usage());

  if (!have_dir) {
    ModelConfig config = resolve_model_config(config_arg);
    print_summary(config);
    print_counts(config);
    if (args.flag("tensors")) {
      std::printf("\ntensors (fused expert layout)\n");
      for (const ParamSpec& spec : build_param_table(config)) {
        std::printf("  %-72s %-22s %-5s %s %s\n", spec.name.c_str(), spec.shape.str().c_str(),
                    std::string(dtype_safetensors_name(spec.dtype)).c_str(), spec.trainable ? "train " : "frozen",
                    component_name(spec.component));
      }
    }
    return 0;
  }

  const std::string dir = args.get("dir");
  CheckpointReport report;
  ModelCheckpoint checkpoint = load_model_dir(dir, &report);
  print_summary(checkpoint.config);
  print_counts(checkpoint.config);
  WeightsDir weights = open_weights_dir(dir);
  std::printf("\ncheckpoint        %s: %zu file(s)%s, experts stored %s, %zu passthrough tensors (mtp.*)\n",
              dir.c_str(), weights.files.size(), weights.sharded ? " + index" : "",
              expert_layout_name(checkpoint.expert_layout), checkpoint.passthrough.size());
  std::map<std::string, int> dtype_counts;
  for (const auto& [name, tensor] : checkpoint.params)
    dtype_counts[std::string(dtype_safetensors_name(tensor.dtype()))]++;
  std::printf("dtypes           ");
  for (const auto& [dtype, count] : dtype_counts) std::printf(" %s x%d", dtype.c_str(), count);
  std::printf("\n");
  if (args.flag("tensors")) {
    std::printf("\ntensors (fused in-memory layout, dtype as stored)\n");
    for (const ParamSpec& spec : build_param_table(checkpoint.config)) {
      auto found = checkpoint.params.find(spec.name);
      std::string dtype =
          found == checkpoint.params.end() ? "-" : std::string(dtype_safetensors_name(found->second.dtype()));
      std::printf("  %-72s %-22s %-5s %s %s\n", spec.name.c_str(), spec.shape.str().c_str(), dtype.c_str(),
                  spec.trainable ? "train " : "frozen", component_name(spec.component));
    }
    for (const auto& [name, tensor] : checkpoint.passthrough) {
      std::printf("  %-72s %-22s %-5s passthrough\n", name.c_str(), tensor.shape().str().c_str(),
                  std::string(dtype_safetensors_name(tensor.dtype())).c_str());
    }
  }
  if (!report.ok()) {
    std::printf("\nINCOMPLETE: %s", report.describe(dir).c_str());
    return 1;
  }
  std::printf("\ncomplete: every parameter present with the expected shape\n");
  return 0;
}

}  // namespace deltamoe
