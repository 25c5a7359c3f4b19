// A 64-bit FNV-1a fingerprint of a host tensor's bytes. Tests print it beside a result so that
// two builds of a kernel (a change meant to move data only, against its parent) can be shown to
// give the same bits on the GPU without carrying the results themselves.
#pragma once

#include <cstdint>
#include <cstdio>

#include "core/tensor.h"

namespace deltamoe {

inline uint64_t bit_fingerprint(const HostTensor& t) {
  const auto* bytes = static_cast<const unsigned char*>(t.data());
  uint64_t hash = 14695981039346656037ull;
  for (size_t i = 0; i < t.nbytes(); ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
  return hash;
}

// Prints "  BITS <label> <name> <fingerprint>" lines, one per tensor.
inline void print_bit_fingerprint(const char* label, const char* name, const HostTensor& t) {
  std::printf("  BITS %s %s %016llx\n", label, name, static_cast<unsigned long long>(bit_fingerprint(t)));
}

}  // namespace deltamoe
