// --expert_grad_dtype: declared and parsed once for every command that builds an engine or plans one.
#include "cli/grad_dtype_flag.h"

#include "core/error.h"

namespace deltamoe {

void declare_expert_grad_dtype_flag(ArgParser& args) {
  args.add_option("expert_grad_dtype",
                  "bf16 or f32: the routed experts' gradients (bf16: each micro-batch's product rounded once, later "
                  "ones added in fp32; half the bytes and memory)",
                  "bf16");
}

DType parse_expert_grad_dtype_flag(const ArgParser& args) {
  const std::string value = args.get("expert_grad_dtype");
  CHECK(value == "bf16" || value == "f32", "--expert_grad_dtype must be bf16 or f32, got '", value, "'");
  return value == "bf16" ? DType::bf16 : DType::f32;
}

}  // namespace deltamoe
