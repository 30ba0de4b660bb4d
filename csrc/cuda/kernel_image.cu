// Whether the device in use can run this library's kernels: the CUDA
// runtime is asked about an empty kernel compiled like every other one.
#include "kernel_image.h"

namespace msda::cuda {
namespace {

__global__ void probe() {}

}  // namespace

cudaError_t kernel_image_status() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, probe);
}

}  // namespace msda::cuda
