// Allocation of the tensors the kernels write.
#pragma once

#include <array>
#include <limits>
#include <vector>

#include "overrides.h"
#include "../core/params.h"
#include "../binding/tensor.h"

namespace msda {

// An output the kernels fill completely; NaN-filled first under
// MS_DEFORM_ATTN_POISON=1 (the test suite sets it, overrides.h).
inline Tensor new_output(Sizes sizes, ScalarType dtype, const Device& device) {
  if (poison_outputs()) return full(sizes, std::numeric_limits<double>::quiet_NaN(), dtype, device);
  return empty(sizes, dtype, device);
}
inline Tensor new_output(SizeList sizes, ScalarType dtype, const Device& device) {
  return new_output(sizes_in(sizes), dtype, device);
}

// A tensor of value's shape (N, S, M, D) and layout (pb.value_head_major:
// the transposed view of a contiguous (N, M, S, D) one), for grad_value and
// its accumulator: zeroed, or an output the kernels fill completely.
inline Tensor value_shaped(const Problem& pb, ScalarType dtype, const Device& device, bool zeroed) {
  const bool hm = pb.value_head_major;
  const std::array<int64_t, 4> shape = hm ? std::array<int64_t, 4>{pb.N, pb.M, pb.S, pb.D}
                                          : std::array<int64_t, 4>{pb.N, pb.S, pb.M, pb.D};
  Tensor t = zeroed ? zeros(shape, dtype, device) : new_output(shape, dtype, device);
  return hm ? transpose(t, 1, 2) : t;
}

}  // namespace msda
