// The CUDA host code's glue to torch, through the stable ABI: the current
// stream of a device, the device guard, and CUDA errors raised as errors.
#pragma once

#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "../binding/tensor.h"

#define MSDA_CUDA_CHECK(expr)                                                          \
  do {                                                                                 \
    const cudaError_t msda_err_ = (expr);                                              \
    MSDA_CHECK(msda_err_ == cudaSuccess, "ms_deform_attn: CUDA error: ",               \
               cudaGetErrorString(msda_err_), " (", cudaGetErrorName(msda_err_), ")"); \
  } while (0)

namespace msda::cuda {

// torch's current stream on CUDA device `device` (what ATen's kernels run on).
inline cudaStream_t current_stream(int32_t device) {
  void* stream = nullptr;
  MSDA_SHIM_CHECK(aoti_torch_get_current_cuda_stream(device, &stream));
  return static_cast<cudaStream_t>(stream);
}

// Makes `device` the current CUDA device for the scope and restores the
// previous one after, as c10's CUDAGuard does, through the CUDA runtime
// (the stable ABI's DeviceGuard allocates a c10 guard on the heap on every
// call, and this is on every call's path).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    int current = 0;
    MSDA_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device) {
      MSDA_CUDA_CHECK(cudaSetDevice(device));
      previous_ = current;
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;  // the device to restore, if the guard changed it
};

}  // namespace msda::cuda
