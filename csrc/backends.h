// The backend registry's front, device-agnostic: which backend names exist,
// and the questions ops.cpp answers for Python and C++ callers (which
// backends a device has, what "auto" picks, why a backend cannot run). The
// CUDA part answers them from its backend table (cuda/forward/backends.cpp) through
// BackendHooks, installed when it is compiled in.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/string_view.h>

#include <string>
#include <vector>

#include "backward_plan.h"
#include "params.h"

namespace msda {

// Every backend name of the library, whatever the build: "cpu" and the CUDA
// backends in the order "auto" prefers them.
const std::vector<std::string>& backend_names();

// Raises unless `backend` is "auto" or one of backend_names().
void check_backend_name(c10::string_view backend);

// What the CUDA backend table answers.
struct BackendHooks {
  // Backends that can run on this device at all (arch, build), in preference order.
  std::vector<std::string> (*available)(int device) = nullptr;
  // The backend "auto" resolves to for these inputs.
  std::string (*select)(const Problem& pb, int device) = nullptr;
  // Why backend `name` cannot run these inputs ("" when it can).
  std::string (*reason)(const std::string& name, const Problem& pb, int device) = nullptr;
  // The limits of CUDA device `device` that the backward planner reads.
  BackwardDevice (*backward_device)(int device) = nullptr;
};
BackendHooks& cuda_hooks();

std::vector<std::string> available_backends(c10::Device device);
// For inputs already validated (check_inputs) on `device`.
std::string select_backend(const Problem& pb, c10::Device device);
std::string backend_reason(c10::string_view backend, const Problem& pb, c10::Device device);

}  // namespace msda
