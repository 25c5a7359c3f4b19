// Which kernel family runs on the current GPU (kernel_path_cuda.h): the GPU's compute capability
// and the architecture of the code loaded for it, read from a probe kernel of this library.
#include "kernels/common/kernel_path_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <optional>

#include "core/cuda_check.h"
#include "core/device_alloc.h"
#include "core/error.h"

// Hopper code must be sm_90a: plain sm_90 code would carry the wgmma kernels with empty bodies
// and report the same architecture (90) as sm_90a code, so the probe could not tell them apart.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && (__CUDA_ARCH__ < 1000) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "build Hopper code as sm_90a (CMAKE_CUDA_ARCHITECTURES 90a), not sm_90"
#endif

#ifndef DELTAMOE_CUDA_ARCHITECTURES
#define DELTAMOE_CUDA_ARCHITECTURES "unknown"
#endif

namespace deltamoe {
namespace {

// Compiled like every kernel of the library (one CMAKE_CUDA_ARCHITECTURES for all): the code the
// driver loads for it is the code it loads for the others.
__global__ void kernel_path_probe() {}

KernelPath query(int device) {
  KernelPath path;
  int major = 0, minor = 0, optin = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attributes{};
  const cudaError_t status = cudaFuncGetAttributes(&attributes, kernel_path_probe);
  CHECK(status == cudaSuccess, "kernel path: this binary has no device code the GPU (sm_", major, minor,
        ") can run (built for ", DELTAMOE_CUDA_ARCHITECTURES, "): ", cudaGetErrorString(status));
  path.device_arch = major * 10 + minor;
  path.code_arch = attributes.ptxVersion;
  path.binary_arch = attributes.binaryVersion;
  path.sm90a = major == 9 && path.code_arch >= 90;
  path.max_shared_bytes =
      path.sm90a ? static_cast<size_t>(optin) : std::min(static_cast<size_t>(optin), kSm80MaxSharedBytesPerBlock);
  return path;
}

}  // namespace

std::string KernelPath::describe() const {
  if (binary_arch == code_arch) return name();
  return str_cat(name(), " (compute_", code_arch, " PTX on sm_", binary_arch, ")");
}

const KernelPath& kernel_path() {
  static std::mutex mutex;
  static std::array<std::optional<KernelPath>, 64> cached;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CHECK(device >= 0 && device < static_cast<int>(cached.size()), "kernel path: device ", device, " out of range");
  std::lock_guard<std::mutex> lock(mutex);
  std::optional<KernelPath>& slot = cached[static_cast<size_t>(device)];
  if (!slot) slot = query(device);
  return *slot;  // never changed once set
}

bool sm90a_kernels_usable() {
  int device = 0, count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0 || cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();  // clear it, so that later checks do not report it
    return false;
  }
  return kernel_path().sm90a;
}

void require_sm90a_kernels(const char* who) {
  const KernelPath& path = kernel_path();
  CHECK(path.sm90a, who, ": needs the sm_90a kernels, but this process runs the ", path.describe(),
        " path (GPU sm_", path.device_arch, ", binary built for ", cuda_architectures(),
        "); the sm_90a kernels need a compute-capability-9 GPU and a build that includes 90a");
}

void allow_dynamic_shared_memory(const void* kernel, size_t bytes, const char* who) {
  const KernelPath& path = kernel_path();
  CHECK(bytes <= path.max_shared_bytes, who, ": needs ", bytes, " bytes of shared memory per block, the ",
        path.describe(), " path allows ", path.max_shared_bytes);
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

const char* cuda_architectures() { return DELTAMOE_CUDA_ARCHITECTURES; }

namespace kernel_path_detail {
namespace {

__global__ void report_kernel(int* out) {
#if defined(__CUDA_ARCH__)
  out[0] = __CUDA_ARCH__;
#endif
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  out[1] = 1;
#else
  out[1] = 0;
#endif
}

// Writes through the whole of its dynamic shared memory and back out, so that a launch with less
// than it was given would fault or read garbage.
__global__ void shared_memory_kernel(int* out, int words) {
  extern __shared__ int shared_words[];
  for (int i = static_cast<int>(threadIdx.x); i < words; i += static_cast<int>(blockDim.x)) shared_words[i] = i;
  __syncthreads();
  if (threadIdx.x == 0) out[0] = shared_words[words - 1];
}

}  // namespace

DeviceCodeReport report_device_code() {
  int* device_out = nullptr;
  device_out = static_cast<int*>(device_malloc(2 * sizeof(int), "kernel path probe"));
  CUDA_CHECK(cudaMemset(device_out, 0, 2 * sizeof(int)));
  report_kernel<<<1, 1>>>(device_out);
  const cudaError_t launched = cudaGetLastError();
  int host[2] = {0, 0};
  const cudaError_t copied = cudaMemcpy(host, device_out, sizeof(host), cudaMemcpyDeviceToHost);
  CUDA_CHECK(cudaFree(device_out));
  CUDA_CHECK(launched);
  CUDA_CHECK(copied);
  return {host[0], host[1] == 1};
}

void launch_with_shared_memory(size_t bytes) {
  CHECK(bytes >= sizeof(int) && bytes % sizeof(int) == 0, "launch_with_shared_memory: ", bytes,
        " bytes is not a positive number of ints");
  allow_dynamic_shared_memory(shared_memory_kernel, bytes, "kernel path test");
  const int words = static_cast<int>(bytes / sizeof(int));
  int* device_out = nullptr;
  device_out = static_cast<int*>(device_malloc(sizeof(int), "kernel path probe"));
  shared_memory_kernel<<<1, 256, bytes>>>(device_out, words);
  const cudaError_t launched = cudaGetLastError();
  int host = -1;
  const cudaError_t copied = cudaMemcpy(&host, device_out, sizeof(int), cudaMemcpyDeviceToHost);
  CUDA_CHECK(cudaFree(device_out));
  CUDA_CHECK(launched);
  CUDA_CHECK(copied);
  CHECK(host == words - 1, "launch_with_shared_memory: read back ", host, ", expected ", words - 1);
}

}  // namespace kernel_path_detail

}  // namespace deltamoe
