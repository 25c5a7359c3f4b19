// --expert_recv_headroom, shared by `train`, `bench` and `plan`: the receive capacity of a rank's
// experts per micro-batch and layer over the mean (tokens x top-k), which sizes the expert
// exchange's buffers (ParallelOptions::expert_recv_headroom, model/text/expert_exchange_size.h).
#pragma once

#include <string>

#include "cli/args.h"

namespace deltamoe {

void declare_expert_recv_headroom_flag(ArgParser& args, const char* default_value);
// "auto" -> 0; a number >= 1 as given; anything else is refused naming the flag.
double parse_expert_recv_headroom(const std::string& text);

}  // namespace deltamoe
