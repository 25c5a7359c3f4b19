// DELTAMOE_HOST_DEVICE: a function compiled for the host and, under nvcc, for the device too (plain
// arithmetic shared by kernels and their host-side planners and tests).
#pragma once

#if defined(__CUDACC__)
#define DELTAMOE_HOST_DEVICE __host__ __device__
#else
#define DELTAMOE_HOST_DEVICE
#endif
