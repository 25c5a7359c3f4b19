// DeviceBf16: the element type of bf16 device buffers. CUDA builds use __nv_bfloat16; CPU builds,
// which only count the bytes of activation layouts (the memory planner) and never read them, a
// 2-byte stand-in, so the layout code is one piece of code for both.
#pragma once

#include <cstdint>

#if defined(DELTAMOE_WITH_CUDA)
#include <cuda_bf16.h>
namespace deltamoe {
using DeviceBf16 = __nv_bfloat16;
}  // namespace deltamoe
#else
namespace deltamoe {
struct DeviceBf16 {
  uint16_t bits;
};
}  // namespace deltamoe
#endif

static_assert(sizeof(deltamoe::DeviceBf16) == 2);
