// The CUDA backward's host side, for the operator in ../msda_cuda.cpp: the
// plan for a call (../../plan/backward_plan.h, from the device's DeviceInfo, the
// call's alignments and the environment's override), and the buffers and
// launches of the plan's grad_value path.
#pragma once

#include <cuda_runtime.h>

#include "../../plan/backward_plan.h"
#include "../../params.h"
#include "../../validation.h"

namespace msda::cuda {

// The plan for backward params p (value, grad_out and pb set) of the plain
// (fused = false) or fused operator.
BackwardPlan plan_for(const BackwardParams& p, bool fused, bool deterministic);

// Runs the dots kernel and the grad_value path of p.plan (p: everything but
// grad_value set) and returns grad_value in value's dtype and layout. The
// atomic path writes into a zeroed fp32 (fp64) accumulator and converts it;
// the sorted and block-local paths write grad_value once, the same bits on
// every run.
Tensor run_backward(BackwardParams p, const Prepared& in, cudaStream_t stream);

}  // namespace msda::cuda
