// The CUDA backward's host side, for the operator in ../msda_cuda.cpp: the
// buffers and launches of a plan's grad_value path (the plan:
// plan_backward_for, ../../backend_queries.h).
#pragma once

#include <cuda_runtime.h>

#include "../../plan/backward_plan.h"
#include "../../core/params.h"
#include "../../operator/validation.h"

namespace msda::cuda {

// Runs the dots kernel and the grad_value path of p.plan (p: everything but
// grad_value set) and returns grad_value in value's dtype and layout. The
// atomic path writes into a zeroed fp32 (fp64) accumulator and converts it;
// the sorted and block-local paths write grad_value once, the same bits on
// every run.
Tensor run_backward(BackwardParams p, const Prepared& in, cudaStream_t stream);

}  // namespace msda::cuda
