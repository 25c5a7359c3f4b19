// Plain CPU reference of the grouped products: a loop over groups, rows and columns.
#include "core/error.h"
#include "kernels/grouped_gemm/grouped_gemm.h"

namespace deltamoe {

namespace {

void check_offsets(const int32_t* offsets, int64_t num_groups) {
  CHECK(num_groups >= 1, "grouped_gemm: need at least one group, got ", num_groups);
  CHECK(offsets[0] == 0, "grouped_gemm: offsets[0] must be 0, got ", offsets[0]);
  for (int64_t g = 0; g < num_groups; ++g)
    CHECK(offsets[g + 1] >= offsets[g], "grouped_gemm: offsets decrease at group ", g, " (", offsets[g], " -> ",
          offsets[g + 1], ")");
}

}  // namespace

template <typename T>
void grouped_gemm_rows_ref(const T* a, const T* b, bool b_stored_nk, T* c, const int32_t* offsets, int64_t num_groups,
                           int64_t n, int64_t k) {
  check_offsets(offsets, num_groups);
  for (int64_t g = 0; g < num_groups; ++g) {
    const T* b_g = b + g * n * k;
    for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) {
      for (int64_t j = 0; j < n; ++j) {
        T sum = 0;
        for (int64_t i = 0; i < k; ++i) sum += a[r * k + i] * (b_stored_nk ? b_g[j * k + i] : b_g[i * n + j]);
        c[r * n + j] = sum;
      }
    }
  }
}

template <typename T>
void grouped_gemm_weight_grad_ref(const T* a, const T* b, T* c, const int32_t* offsets, int64_t num_groups, int64_t m,
                                  int64_t n) {
  check_offsets(offsets, num_groups);
  for (int64_t g = 0; g < num_groups; ++g) {
    T* c_g = c + g * m * n;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        T sum = 0;
        for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) sum += a[r * m + i] * b[r * n + j];
        c_g[i * n + j] += sum;
      }
    }
  }
}

#define INSTANTIATE(T)                                                                                             \
  template void grouped_gemm_rows_ref<T>(const T*, const T*, bool, T*, const int32_t*, int64_t, int64_t, int64_t); \
  template void grouped_gemm_weight_grad_ref<T>(const T*, const T*, T*, const int32_t*, int64_t, int64_t, int64_t);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace deltamoe
