// Whether this library holds a kernel image the current device runs
// (kernel_image.cu). cudaErrorNoKernelImageForDevice when it holds none.
#pragma once

#include <cuda_runtime_api.h>

namespace msda::cuda {

cudaError_t kernel_image_status();

}  // namespace msda::cuda
