// The flags of `deltamoe train` (with other tools' names through flag_compat.h) and their reading
// into TrainOptions; cmd_train.cc runs them, the tests parse real command lines with them.
#pragma once

#include "cli/args.h"
#include "cli/swift_env.h"
#include "train/train_options.h"

namespace deltamoe {

void declare_train_flags(ArgParser& args);

// The parsed flags (and, where a flag is not given, ms-swift's environment variables) as options;
// what needs the model folder goes into `request` for resolve_train_options.
TrainOptions train_options_from_args(const ArgParser& args, const SwiftEnv& env, TrainOptionsRequest& request);

}  // namespace deltamoe
