// Host entry points of the CUDA kernels. ATen-free: the binding layer fills
// the params structs; each launcher dispatches on dtype and returns the launch
// status for the binding to check.
#pragma once

#include <cuda_runtime.h>

#include "../params.h"

namespace msda::cuda {

// Forward backends.
cudaError_t baseline_forward(const ForwardParams& p, cudaStream_t stream);
cudaError_t persistent_forward(const ForwardParams& p, cudaStream_t stream);
int64_t persistent_workspace_bytes(const Problem& pb);  // its zeroed tile counters

// Backward shared by every forward backend. grad_value_acc must be zeroed.
cudaError_t backward(const BackwardParams& p, cudaStream_t stream);

}  // namespace msda::cuda
