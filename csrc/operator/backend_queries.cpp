// The backend questions for any device (backend_queries.h).
#include "backend_queries.h"

#include "../binding/check.h"

#include <sstream>

#include "overrides.h"

namespace msda {
namespace {

CudaDeviceInfoFn& device_info_fn() {
  static CudaDeviceInfoFn fn = nullptr;
  return fn;
}

std::string no_kernel(Device device) {
  std::ostringstream os;
  os << "no kernel for device " << device_name(device) << " in this build";
  return os.str();
}

}  // namespace

void set_cuda_device_info(CudaDeviceInfoFn fn) { device_info_fn() = fn; }

std::optional<DeviceInfo> cuda_device_info(int device) {
  return device_info_fn() == nullptr ? std::nullopt : device_info_fn()(device);
}

std::vector<std::string> available_backends(Device device) {
  if (device.is_cpu()) return backends_on(Runs::cpu, nullptr);
  if (!device.is_cuda()) return {};
  const auto info = cuda_device_info(device.has_index() ? device.index() : -1);
  return info ? backends_on(Runs::cuda, &*info) : std::vector<std::string>{};
}

ForwardWishes forward_wishes(std::string_view backend) {
  ForwardWishes w;
  w.backend = std::string(backend);
  if (w.backend == "auto") {
    if (std::string name = backend_override(); !name.empty()) w.backend = name;
  }
  w.blocked_rows = blocked_rows_override();
  w.smem_budget = smem_budget_override();
  return w;
}

ForwardPlan plan_forward_for(const ForwardProblem& p, Device device, std::string_view backend,
                             const std::optional<DeviceInfo>& info) {
  if (!info && device.is_cpu()) {
    const std::string why = backend_reason(backend, p, device);
    MSDA_CHECK(why.empty(), "ms_deform_attn: backend '", backend, "' ", why);
    ForwardPlan plan;
    plan.backend = ForwardBackend::cpu;
    return plan;
  }
  const auto d = info ? info : device.is_cuda() ? cuda_device_info(device.index()) : std::nullopt;
  MSDA_CHECK(d.has_value(), "ms_deform_attn: ", no_kernel(device));
  return plan_forward(p, *d, forward_wishes(backend));
}

BackwardPlan plan_backward_for(const BackwardProblem& p, Device device, bool deterministic,
                               std::string_view grad_value, const std::optional<DeviceInfo>& info) {
  BackwardWishes w;
  w.deterministic = deterministic;
  w.stage = local_stage_override();
  w.self_records = local_self_override();
  w.request = grad_value == "auto" ? grad_value_override()
                                   : parse_grad_value_request(std::string(grad_value));
  DeviceInfo d;
  if (info) {
    d = *info;
  } else if (device.is_cuda()) {
    const auto found = cuda_device_info(device.index());
    MSDA_CHECK(found.has_value(), "ms_deform_attn: ", no_kernel(device));
    d = *found;
  }
  return plan_backward(p, d, w);
}

std::string backend_reason(std::string_view backend, const ForwardProblem& p, Device device) {
  const std::string name(backend);
  if (device.is_cpu()) return backend_reason_on(name, p, Runs::cpu, nullptr);
  const auto d = device.is_cuda() ? cuda_device_info(device.index()) : std::nullopt;
  if (!d) return no_kernel(device);
  return backend_reason_on(name, p, Runs::cuda, &*d);
}

}  // namespace msda
