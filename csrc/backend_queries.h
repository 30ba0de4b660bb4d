// The backend questions, for any device: which backends a device has, the
// plan the forward makes on it (and so what "auto" picks), why a backend
// cannot run some inputs. The CPU's answers are here; a CUDA device's come
// from the forward planner (plan/forward_plan.h) with that device's
// DeviceInfo, which the CUDA part provides (cuda/device_info.cpp) when it is
// compiled in. ops.cpp answers Python and C++ callers from here; the
// operators ask here too.
#pragma once

#include "tensor.h"

#include <optional>
#include <string>
#include <vector>

#include "plan/forward_plan.h"

namespace msda {

// The DeviceInfo of CUDA device `device` (-1: the current one), nullopt
// where no CUDA device is usable or the build has no CUDA kernels.
using CudaDeviceInfoFn = std::optional<DeviceInfo> (*)(int device);
void set_cuda_device_info(CudaDeviceInfoFn fn);
std::optional<DeviceInfo> cuda_device_info(int device);

std::vector<std::string> available_backends(Device device);
// The caller's backend with the environment's overrides (MS_DEFORM_ATTN_BACKEND
// for "auto", and the test hooks; overrides.h).
ForwardWishes forward_wishes(std::string_view backend);
// The plan for p on `device` with `backend` asked for (CPU tensors: the
// `cpu` kernel); raises with the reason when that backend cannot run p.
// `info`: plan for this CUDA device instead of `device`'s (the queries' hook
// for devices that are not there).
ForwardPlan forward_plan(const ForwardProblem& p, Device device, std::string_view backend,
                         const std::optional<DeviceInfo>& info = std::nullopt);
// Why `backend` cannot run p on `device` ("" when it can).
std::string backend_reason(std::string_view backend, const ForwardProblem& p, Device device);

}  // namespace msda
