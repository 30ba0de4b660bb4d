// The deterministic backward's grad_value (deterministic.cpp), for the
// operator in msda_cuda.cpp.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include "../params.h"
#include "../validation.h"

namespace msda::cuda {

// grad_value by sort and gather (backward_deterministic.cu): bitwise the same
// on every run. p is the backward's params with everything but grad_value set.
at::Tensor deterministic_grad_value(BackwardParams p, const Prepared& in, cudaStream_t stream);

}  // namespace msda::cuda
