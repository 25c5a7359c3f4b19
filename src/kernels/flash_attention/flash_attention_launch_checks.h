// Host checks shared by the flash-attention launchers: the backward workspace size, and the null
// and alignment rules of the tensor-core kernels (16-byte row loads, bf16-pair stores).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "kernels/flash_attention/flash_attention_cuda.h"

namespace deltamoe::flash_attention_detail {

inline bool is_aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

inline void check_backward_workspace(const FlashAttentionShape& shape, size_t workspace_bytes, const char* where) {
  const size_t needed = flash_attention_backward_workspace_bytes(shape);
  CHECK(workspace_bytes >= needed, where, ": workspace of ", workspace_bytes, " bytes is smaller than the ", needed,
        " bytes needed (flash_attention_backward_workspace_bytes)");
}

inline void check_forward_mma_pointers(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                                       const __nv_bfloat16* out, const float* lse, const char* where) {
  CHECK(q && k && v && out && lse, where, ": null tensor pointer");
  for (const void* p : {static_cast<const void*>(q), static_cast<const void*>(k), static_cast<const void*>(v)})
    CHECK(is_aligned(p, 16), where, ": q/k/v must be 16-byte aligned");
  CHECK(is_aligned(out, 4), where, ": out must be 4-byte aligned");
}

inline void check_backward_mma_pointers(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                                        const __nv_bfloat16* out, const float* lse, const __nv_bfloat16* d_out,
                                        const __nv_bfloat16* dq, const __nv_bfloat16* dk, const __nv_bfloat16* dv,
                                        const void* workspace, const char* where) {
  CHECK(q && k && v && out && lse && d_out && dq && dk && dv && workspace, where, ": null tensor or workspace pointer");
  for (const void* p : {static_cast<const void*>(q), static_cast<const void*>(k), static_cast<const void*>(v),
                        static_cast<const void*>(d_out)})
    CHECK(is_aligned(p, 16), where, ": q, k, v and d_out must be 16-byte aligned");
  for (const void* p : {static_cast<const void*>(dq), static_cast<const void*>(dk), static_cast<const void*>(dv)})
    CHECK(is_aligned(p, 4), where, ": dq, dk and dv must be 4-byte aligned");
}

}  // namespace deltamoe::flash_attention_detail
