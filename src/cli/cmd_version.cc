// `deltamoe version`: version and whether this build has CUDA.
#include <cstdio>

#include "cli/args.h"
#include "cli/commands.h"

namespace deltamoe {

int cmd_version(int argc, char** argv) {
  ArgParser args("version", "print the version and build configuration");
  if (!args.parse(argc, argv)) return 0;
#ifdef DELTAMOE_WITH_CUDA
  const char* cuda = "with CUDA (sm_80, sm_90a)";
#else
  const char* cuda = "CPU only";
#endif
  std::printf("deltamoe %s, %s\n", DELTAMOE_VERSION, cuda);
  return 0;
}

}  // namespace deltamoe
