// One row per warp with the row in registers: lane l holds the PER adjacent elements
// [l PER, l PER + PER) of a bf16 row of D <= 32 PER elements (PER in {1, 2, 4, 8, 16, 32}), loaded
// and stored as 4- to 16-byte vectors when D = 32 PER and the rows are 16-byte aligned ("FULL"),
// element by element (zeros past D) otherwise. Used by the row-wise norms of the GDN (l2norm,
// gated_rmsnorm), whose rows are the 128-wide heads.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace deltamoe {

// The lane's PER elements [lane PER, lane PER + PER) of a row; past D they read 0. FULL: D = 32 PER
// and rows aligned, so they load as vectors of up to 8.
template <int PER, bool FULL>
__device__ __forceinline__ void warp_row_load(const __nv_bfloat16* row, int dim, int lane, float (&v)[PER]) {
  const int base = lane * PER;
  if constexpr (FULL && PER >= 2) {
    constexpr int kVec = PER < 8 ? PER : 8;
#pragma unroll
    for (int i = 0; i < PER; i += kVec) {
      __nv_bfloat162 pairs[kVec / 2];
      if constexpr (kVec == 8) {
        *reinterpret_cast<uint4*>(pairs) = *reinterpret_cast<const uint4*>(row + base + i);
      } else if constexpr (kVec == 4) {
        *reinterpret_cast<uint2*>(pairs) = *reinterpret_cast<const uint2*>(row + base + i);
      } else {
        *reinterpret_cast<unsigned*>(pairs) = *reinterpret_cast<const unsigned*>(row + base + i);
      }
#pragma unroll
      for (int k = 0; k < kVec / 2; ++k) {
        const float2 f = __bfloat1622float2(pairs[k]);
        v[i + 2 * k] = f.x;
        v[i + 2 * k + 1] = f.y;
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < PER; ++i) v[i] = base + i < dim ? __bfloat162float(row[base + i]) : 0.0f;
  }
}

template <int PER, bool FULL>
__device__ __forceinline__ void warp_row_store(__nv_bfloat16* row, int dim, int lane, const float (&v)[PER]) {
  const int base = lane * PER;
  if constexpr (FULL && PER >= 2) {
    constexpr int kVec = PER < 8 ? PER : 8;
#pragma unroll
    for (int i = 0; i < PER; i += kVec) {
      __nv_bfloat162 pairs[kVec / 2];
#pragma unroll
      for (int k = 0; k < kVec / 2; ++k) pairs[k] = __floats2bfloat162_rn(v[i + 2 * k], v[i + 2 * k + 1]);
      if constexpr (kVec == 8) {
        *reinterpret_cast<uint4*>(row + base + i) = *reinterpret_cast<const uint4*>(pairs);
      } else if constexpr (kVec == 4) {
        *reinterpret_cast<uint2*>(row + base + i) = *reinterpret_cast<const uint2*>(pairs);
      } else {
        *reinterpret_cast<unsigned*>(row + base + i) = *reinterpret_cast<const unsigned*>(pairs);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < PER; ++i)
      if (base + i < dim) row[base + i] = __float2bfloat16(v[i]);
  }
}

inline bool warp_row_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Calls f.template operator()<PER, FULL>() for the smallest PER in {1, 2, 4, 8, 16, 32} with 32 PER >= dim;
// FULL when dim = 32 PER and every row pointer is aligned for the vector accesses.
template <typename F>
inline void with_warp_row_width(int dim, bool pointers_aligned, F&& f) {
  int per = 1;
  while (32 * per < dim) per *= 2;
  const bool full = dim == 32 * per && pointers_aligned;
  switch (per) {
    case 1: full ? f.template operator()<1, true>() : f.template operator()<1, false>(); break;
    case 2: full ? f.template operator()<2, true>() : f.template operator()<2, false>(); break;
    case 4: full ? f.template operator()<4, true>() : f.template operator()<4, false>(); break;
    case 8: full ? f.template operator()<8, true>() : f.template operator()<8, false>(); break;
    case 16: full ? f.template operator()<16, true>() : f.template operator()<16, false>(); break;
    default: full ? f.template operator()<32, true>() : f.template operator()<32, false>(); break;
  }
}

}  // namespace deltamoe
