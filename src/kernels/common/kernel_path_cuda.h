// The one place that says which kernel family this process runs on the current GPU. The sm_90a
// kernels (the wgmma + TMA grouped GEMM; cuDNN's fused SDPA, used with them as the Hopper path) run
// only where the GPU has compute capability 9.x AND the code this binary loads for it was compiled
// for sm_90a; everywhere else the sm_80 kernels run (mma.sync + cp.async, our flash attention) and
// no block may ask for more than sm_80's 163 KB of shared memory. A build for `80-virtual`
// (compute_80 PTX only, compiled by the driver at load time) therefore takes on the H200 the path
// an A800 takes, which is how that path is tested (tools/gpu/sm80_path.sh).
//
// Why the binary and not only the GPU: a kernel whose body is guarded by the sm_90a feature macro
// is compiled empty for compute_80, and launching it on an H200 would run and write nothing. The
// loaded code's architecture comes from cudaFuncGetAttributes on a probe kernel of this library
// (host-side queries, no sync), cached per device.
#pragma once

#include <cstddef>
#include <string>

namespace deltamoe {

// Dynamic shared memory one block may opt into on sm_80 (A100/A800): 163 KB.
constexpr size_t kSm80MaxSharedBytesPerBlock = 163 * 1024;

struct KernelPath {
  bool sm90a = false;           // the sm_90a kernels may run
  int device_arch = 0;          // the GPU's compute capability, major * 10 + minor (90 on the H200)
  int code_arch = 0;            // virtual architecture of the loaded device code (80 or 90)
  int binary_arch = 0;          // architecture of the machine code that runs (90 where the driver
                                // compiled compute_80 PTX for the H200)
  size_t max_shared_bytes = 0;  // dynamic shared memory a block may opt into on this path

  // "sm_90a" or "sm_80".
  const char* name() const { return sm90a ? "sm_90a" : "sm_80"; }
  // name() and, where the driver compiled PTX for another GPU, what ran where:
  // "sm_80 (compute_80 PTX on sm_90)".
  std::string describe() const;
};

// The current device's path (cached per device). Raises when there is no usable device.
const KernelPath& kernel_path();

// kernel_path().sm90a, and false without a usable device (memory planning may run on a machine
// without one; the CUDA error is cleared).
bool sm90a_kernels_usable();

// Raises, naming `who`, the path and why, unless the sm_90a kernels may run: for callers that ask
// for a Hopper-only kernel by name.
void require_sm90a_kernels(const char* who);

// cudaFuncSetAttribute(kernel, MaxDynamicSharedMemorySize, bytes) after checking `bytes` against
// the path's limit; raises with `who` and both sizes when a kernel asks for more.
void allow_dynamic_shared_memory(const void* kernel, size_t bytes, const char* who);
template <typename Kernel>
void allow_dynamic_shared_memory(Kernel* kernel, size_t bytes, const char* who) {
  allow_dynamic_shared_memory(reinterpret_cast<const void*>(kernel), bytes, who);
}

namespace kernel_path_detail {

// What the device code that runs reports about itself (tests only: launches one-thread kernels and
// synchronises): __CUDA_ARCH__ (800 for compute_80 code) and whether it was compiled with the
// sm_90a features.
struct DeviceCodeReport {
  int cuda_arch = 0;
  bool sm90a_features = false;
};
DeviceCodeReport report_device_code();

// Launches a kernel that uses `bytes` of dynamic shared memory, after allow_dynamic_shared_memory,
// and synchronises (tests only).
void launch_with_shared_memory(size_t bytes);

}  // namespace kernel_path_detail

// The CUDA architectures this binary was built for, as CMAKE_CUDA_ARCHITECTURES named them
// ("80,90a", "90a", "80-virtual").
const char* cuda_architectures();

}  // namespace deltamoe
