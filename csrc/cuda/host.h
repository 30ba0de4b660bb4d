// The CUDA host code's glue to torch, through the stable ABI: the current
// stream of a device, the device guard, and CUDA errors raised as errors.
#pragma once

#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>

#include "../tensor.h"

namespace msda::cuda {

// torch's current stream on CUDA device `device` (what ATen's kernels run on).
inline cudaStream_t current_stream(int32_t device) {
  void* stream = nullptr;
  MSDA_SHIM_CHECK(aoti_torch_get_current_cuda_stream(device, &stream));
  return static_cast<cudaStream_t>(stream);
}

using DeviceGuard = torch::stable::accelerator::DeviceGuard;

}  // namespace msda::cuda

#define MSDA_CUDA_CHECK(expr)                                                          \
  do {                                                                                 \
    const cudaError_t msda_err_ = (expr);                                              \
    MSDA_CHECK(msda_err_ == cudaSuccess, "ms_deform_attn: CUDA error: ",               \
               cudaGetErrorString(msda_err_), " (", cudaGetErrorName(msda_err_), ")"); \
  } while (0)
