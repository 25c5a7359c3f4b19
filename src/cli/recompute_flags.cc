// Recompute flags (recompute_flags.h).
#include "cli/recompute_flags.h"

#include <string>

#include "core/error.h"

namespace deltamoe {

void declare_recompute_flags(ArgParser& args, const char* default_choice) {
  args.add_option("recompute", "activation recompute: none, selective (GDN/attention internals), full (whole "
                  "decoder layers, --recompute_num_layers of them, and every vision block) or auto (only when the "
                  "run would not fit otherwise: the fewest vision blocks, then decoder layers, that make it fit)",
                  default_choice);
  args.allow_values("recompute", {"none", "selective", "full", "auto"}, "is not a recompute choice: use none, "
                    "selective, full or auto");
  args.add_option("recompute_granularity", "Megatron's name: selective or full (same as --recompute)", "");
  args.add_option("recompute_method", "with full: block (the first --recompute_num_layers layers) or uniform "
                  "(with --recompute_num_layers 1: every layer)", "block");
  args.allow_values("recompute_method", {"block", "uniform"}, "is not a recompute method: use block or uniform");
  args.add_option("recompute_num_layers", "with full: how many decoder layers (0: all)", "0", ArgKind::kInteger);
}

RecomputeOptions parse_recompute_flags(const ArgParser& args) {
  std::string choice = args.get("recompute");
  if (args.has("recompute_granularity")) {
    const std::string granularity = args.get("recompute_granularity");
    CHECK(granularity == "selective" || granularity == "full", "--recompute_granularity must be selective or full, ",
          "got '", granularity, "'");
    CHECK(!args.has("recompute") || choice == granularity, "--recompute ", choice, " and --recompute_granularity ",
          granularity, " disagree: give one of them");
    choice = granularity;
  }
  RecomputeOptions out;
  const int64_t num_layers = args.get_int("recompute_num_layers");
  CHECK(num_layers >= 0, "--recompute_num_layers must be positive (0: all layers), got ", num_layers);
  const bool full = choice == "full";
  CHECK(full || !args.has("recompute_num_layers"), "--recompute_num_layers needs full recompute "
        "(--recompute full or --recompute_granularity full); this run is --recompute ", choice);
  CHECK(full || !args.has("recompute_method"), "--recompute_method needs full recompute "
        "(--recompute full or --recompute_granularity full); this run is --recompute ", choice);
  if (full && args.get("recompute_method") == "uniform") {
    // Megatron's uniform method keeps the input of every group of N layers; deltamoe keeps every
    // layer's input, which is uniform with groups of one.
    CHECK(num_layers == 1, "--recompute_method uniform is supported with --recompute_num_layers 1 (every layer "
          "recomputed from its own input), got ", num_layers, "; use --recompute_method block to recompute the "
          "first N layers");
  }
  out.mixers = choice == "selective";
  out.automatic = choice == "auto";
  if (full) out.layers = args.get("recompute_method") == "uniform" || num_layers == 0 ? kRecomputeAllLayers : num_layers;
  // The ViT's blocks are cheap to rerun for the memory they hold: full recompute takes all of them.
  if (full) out.vision_blocks = kRecomputeAllLayers;
  return out;
}

}  // namespace deltamoe
