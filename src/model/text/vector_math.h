// Small element-wise helpers shared by the text layers (fp32 vectors as activations).
#pragma once

#include <vector>

namespace deltamoe {

using Activation = std::vector<float>;

// dst += src, element-wise (same size).
inline void add_into(Activation& dst, const Activation& src) {
  for (size_t i = 0; i < dst.size(); ++i) dst[i] += src[i];
}

}  // namespace deltamoe
