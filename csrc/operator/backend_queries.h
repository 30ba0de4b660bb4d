// The backend questions, for any device: which backends a device has, the
// plan the forward makes on it (and so what "auto" picks), why a backend
// cannot run some inputs. The CPU's answers are here; a CUDA device's come
// from the forward planner (plan/forward_plan.h) with that device's
// DeviceInfo, which the CUDA part provides (cuda/device_info.cpp) when it is
// compiled in. ops.cpp answers Python and C++ callers from here; the
// operators ask here too.
#pragma once

#include "../binding/tensor.h"

#include <optional>
#include <string>
#include <vector>

#include "../plan/backward_plan.h"
#include "../plan/forward_plan.h"

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
// The one planning path of each pass, for the operators and the queries
// alike: the environment's overrides taken (overrides.h), the device's
// DeviceInfo found, then the pure planner (plan_forward, plan_backward).
//
// The forward's plan for p on `device` with `backend` asked for (CPU
// tensors: the `cpu` kernel); raises with the reason when that backend
// cannot run p. `info`: plan for this CUDA device instead of `device`'s
// (the queries' hook for devices that are not there).
ForwardPlan plan_forward_for(const ForwardProblem& p, Device device, std::string_view backend,
                             const std::optional<DeviceInfo>& info = std::nullopt);
// The backward's plan for p on `device`'s CUDA device (`info` instead where
// given; an H100, DeviceInfo's defaults, where neither is): grad_value
// "auto" takes MS_DEFORM_ATTN_GRAD_VALUE, as the backward does.
BackwardPlan plan_backward_for(const BackwardProblem& p, Device device, bool deterministic,
                               std::string_view grad_value = "auto",
                               const std::optional<DeviceInfo>& info = std::nullopt);
// Why `backend` cannot run p on `device` ("" when it can).
std::string backend_reason(std::string_view backend, const ForwardProblem& p, Device device);

}  // namespace msda
