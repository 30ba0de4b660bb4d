// CPU kernels: plain loops over a range of work items; the binding layer runs
// them in parallel with torch's parallel_for.
#pragma once

#include "../core/params.h"

namespace msda::cpu {

// Work items are (n, q, m) groups: [begin, end) of N * Lq * M.
void forward_range(const ForwardParams& p, int64_t begin, int64_t end);

// Work items are (n, m) pairs: [begin, end) of N * M. Each pair owns its slice
// of grad_value, so ranges never write the same element.
void backward_range(const BackwardParams& p, int64_t begin, int64_t end);

}  // namespace msda::cpu
