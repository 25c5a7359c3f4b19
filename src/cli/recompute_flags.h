// The activation-recompute flags of `train` and `bench`, with Megatron's names:
// --recompute_granularity selective|full, --recompute_method block|uniform, --recompute_num_layers N,
// and --recompute none|selective|full|auto as one word (auto: the engine recomputes only when the
// run would not fit otherwise, the fewest layers that make it fit). Full recompute also reruns every
// vision block. docs/training.md, "Recompute".
#pragma once

#include "cli/args.h"
#include "train/train_engine.h"

namespace deltamoe {

// default_choice: what --recompute is when no recompute flag is given ("auto" for train, "none"
// for bench, which measures what it is told).
void declare_recompute_flags(ArgParser& args, const char* default_choice);
// Conflicting or meaningless combinations are refused naming the flags.
RecomputeOptions parse_recompute_flags(const ArgParser& args);

}  // namespace deltamoe
