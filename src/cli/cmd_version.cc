// `deltamoe version`: version and whether this build has CUDA.
#include <cstdio>
#include <string>

#include "cli/args.h"
#include "cli/commands.h"
#ifdef DELTAMOE_WITH_CUDA
#include "kernels/common/kernel_path_cuda.h"
#endif

namespace deltamoe {

int cmd_version(int argc, char** argv) {
  ArgParser args("version", "print the version and build configuration");
  if (!args.parse(argc, argv)) return 0;
#ifdef DELTAMOE_WITH_CUDA
  // The architectures CMAKE_CUDA_ARCHITECTURES named ("80,90a"; "80-virtual": compute_80 PTX only).
  const std::string cuda = std::string("with CUDA (") + cuda_architectures() + ")";
#else
  const std::string cuda = "CPU only";
#endif
  std::printf("deltamoe %s, %s\n", DELTAMOE_VERSION, cuda.c_str());
  return 0;
}

}  // namespace deltamoe
