// --expert_grad_dtype bf16|f32 of `train`, `bench` and `plan`: the type the routed experts'
// gradients are kept in (EngineOptions::expert_grad_dtype; docs/optimizer.md, "How the engines use
// it"). bf16 by default: half the bytes the dW products write and AdamW reads, and half the memory.
#pragma once

#include "cli/args.h"
#include "core/dtype.h"

namespace deltamoe {

void declare_expert_grad_dtype_flag(ArgParser& args);
// Anything but bf16 or f32 is refused naming the flag.
DType parse_expert_grad_dtype_flag(const ArgParser& args);

}  // namespace deltamoe
