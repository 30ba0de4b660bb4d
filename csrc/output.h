// Allocation of the tensors the kernels write.
#pragma once

#include <ATen/ATen.h>

#include <cstdlib>
#include <limits>

namespace msda {

// An output the kernels fill completely. With the environment variable
// MS_DEFORM_ATTN_POISON=1 (the test suite sets it) it is filled with NaN
// first, so that an element a kernel leaves unwritten fails the comparison.
inline at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  static const bool poison = [] {
    const char* env = std::getenv("MS_DEFORM_ATTN_POISON");
    return env != nullptr && env[0] == '1';
  }();
  if (poison) return at::full(sizes, std::numeric_limits<double>::quiet_NaN(), options);
  return at::empty(sizes, options);
}

}  // namespace msda
