// The DeviceInfo (plan/device.h) of a CUDA device, asked of the runtime once
// per device: what the planners read, and the launch code's SM count and
// shared-memory figures. Plain C++ over the CUDA runtime.
#pragma once

#include <cuda_runtime.h>

#include "../plan/device.h"

namespace msda::cuda {

// Device `device`, or the current one when device < 0.
cudaError_t device_info(int device, DeviceInfo& d);

}  // namespace msda::cuda
