// GPU test of the kernel path (kernel_path_cuda.h): what it reports agrees with the GPU, with the
// code the device actually runs (a kernel reporting __CUDA_ARCH__ and the sm_90a features) and
// with the architectures the binary was built for; the shared-memory limit is the path's (sm_80's
// 163 KB on the sm_80 path even on an H200) and holds at launch; asking for the sm_90a kernels on
// the sm_80 path raises. Passes on both paths, checking each path's own facts.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/common/kernel_path_cuda.h"

namespace deltamoe {
namespace {

std::vector<std::string> built_architectures() {
  std::vector<std::string> list;
  std::stringstream stream(cuda_architectures());
  std::string item;
  while (std::getline(stream, item, ',')) list.push_back(item);
  return list;
}

bool built_with_sm90a() {
  for (const std::string& arch : built_architectures())
    if (arch.rfind("90a", 0) == 0) return true;
  return false;
}

TEST(KernelPathGpu, AgreesWithTheGpuAndTheCodeThatRuns) {
  int device = 0;
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  const KernelPath& path = kernel_path();
  const kernel_path_detail::DeviceCodeReport report = kernel_path_detail::report_device_code();
  std::printf("GPU %s (sm_%d%d), built for %s: path %s; code compute_%d, machine code sm_%d; device code reports "
              "__CUDA_ARCH__ %d, sm_90a features %s; shared memory per block %zu of the GPU's %zu\n",
              prop.name, prop.major, prop.minor, cuda_architectures(), path.describe().c_str(), path.code_arch,
              path.binary_arch, report.cuda_arch, report.sm90a_features ? "yes" : "no", path.max_shared_bytes,
              prop.sharedMemPerBlockOptin);
  EXPECT_EQ(path.device_arch, prop.major * 10 + prop.minor);
  EXPECT_EQ(path.binary_arch, path.device_arch) << "the machine code that runs is built for this GPU";
  // The attributes the dispatch reads name the code that runs.
  EXPECT_EQ(report.cuda_arch, path.code_arch * 10);
  EXPECT_EQ(path.sm90a, prop.major == 9 && report.sm90a_features);
  EXPECT_EQ(sm90a_kernels_usable(), path.sm90a);
  // And follow the build: on a Hopper GPU the sm_90a kernels run exactly when 90a was built.
  if (prop.major == 9) {
    EXPECT_EQ(path.sm90a, built_with_sm90a()) << "built for " << cuda_architectures();
  }
  // Code compiled by the driver from another architecture's PTX says so.
  if (path.code_arch != path.binary_arch) {
    EXPECT_NE(path.describe().find(std::string("compute_") + std::to_string(path.code_arch) + " PTX on sm_"),
              std::string::npos)
        << path.describe();
  }
}

TEST(KernelPathGpu, SharedMemoryLimitIsThePaths) {
  int device = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const KernelPath& path = kernel_path();
  if (path.sm90a) {
    EXPECT_EQ(path.max_shared_bytes, static_cast<size_t>(optin));
  } else {
    EXPECT_EQ(path.max_shared_bytes, std::min(static_cast<size_t>(optin), kSm80MaxSharedBytesPerBlock));
  }
  // The whole limit launches; a word more is refused before the launch, even where the GPU (an
  // H200 on the sm_80 path: 227 KB) would allow it.
  EXPECT_NO_THROW(kernel_path_detail::launch_with_shared_memory(path.max_shared_bytes));
  try {
    kernel_path_detail::launch_with_shared_memory(path.max_shared_bytes + sizeof(int));
    ADD_FAILURE() << "a launch above the path's shared-memory limit was allowed";
  } catch (const Error& e) {
    std::printf("refused: %s\n", e.what());
    EXPECT_NE(std::string(e.what()).find(path.name()), std::string::npos) << e.what();
  }
}

TEST(KernelPathGpu, AskingForSm90aKernelsOnTheSm80PathRaises) {
  const KernelPath& path = kernel_path();
  if (path.sm90a) {
    EXPECT_NO_THROW(require_sm90a_kernels("test"));
  } else {
    try {
      require_sm90a_kernels("test");
      ADD_FAILURE() << "require_sm90a_kernels passed on the " << path.describe() << " path";
    } catch (const Error& e) {
      std::printf("refused: %s\n", e.what());
      EXPECT_NE(std::string(e.what()).find("sm_80"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace deltamoe
