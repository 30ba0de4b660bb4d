// Allocation of the tensors the kernels write.
#pragma once

#include <ATen/ATen.h>

#include <limits>
#include <vector>

#include "overrides.h"
#include "params.h"

namespace msda {

// An output the kernels fill completely; NaN-filled first under
// MS_DEFORM_ATTN_POISON=1 (the test suite sets it, overrides.h).
inline at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (poison_outputs()) return at::full(sizes, std::numeric_limits<double>::quiet_NaN(), options);
  return at::empty(sizes, options);
}

// A tensor of value's shape (N, S, M, D) and layout (pb.value_head_major:
// the transposed view of a contiguous (N, M, S, D) one), for grad_value and
// its accumulator: zeroed, or an output the kernels fill completely.
inline at::Tensor value_shaped(const Problem& pb, const at::TensorOptions& options, bool zeroed) {
  const bool hm = pb.value_head_major;
  const std::vector<int64_t> sizes = hm ? std::vector<int64_t>{pb.N, pb.M, pb.S, pb.D}
                                        : std::vector<int64_t>{pb.N, pb.S, pb.M, pb.D};
  at::Tensor t = zeroed ? at::zeros(sizes, options) : new_output(sizes, options);
  return hm ? t.transpose(1, 2) : t;
}

}  // namespace msda
