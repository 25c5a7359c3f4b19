// The NaN/Inf scan of checkpoint weights: a bit test on each element's exponent field, streamed
// piece by piece through StoredTensor::for_each_piece (mapped pages are handed back as it goes),
// so a 70 GB checkpoint is checked at disk speed without 70 GB of RAM.
#pragma once

#include <cstdint>

#include "checkpoint/stored_tensor.h"

namespace deltamoe {

// Index of the first NaN or +-Inf element of a floating tensor (f32, bf16, f16, f64), or -1 when
// every element is finite (and always for integer dtypes).
int64_t first_non_finite_element(const StoredTensor& tensor);

}  // namespace deltamoe
