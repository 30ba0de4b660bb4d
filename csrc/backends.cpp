#include "backends.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace msda {

const std::vector<std::string>& backend_names() {
  static const std::vector<std::string> names = {"cpu", "tma", "cluster", "persistent", "blocked", "baseline"};
  return names;
}

namespace {

std::string quoted(const std::vector<std::string>& names) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < names.size(); ++i) os << (i ? ", '" : "'") << names[i] << "'";
  os << "]";
  return os.str();
}

}  // namespace

void check_backend_name(c10::string_view backend) {
  if (backend == "auto") return;
  for (const auto& n : backend_names()) {
    if (backend == n) return;
  }
  TORCH_CHECK(false, "ms_deform_attn: unknown backend '", backend,
              "'; expected 'auto' or one of ", quoted(backend_names()));
}

BackendHooks& cuda_hooks() {
  static BackendHooks hooks;
  return hooks;
}

std::vector<std::string> available_backends(c10::Device device) {
  if (device.is_cpu()) return {"cpu"};
  if (device.is_cuda() && cuda_hooks().available != nullptr) {
    return cuda_hooks().available(device.has_index() ? device.index() : -1);
  }
  return {};
}

std::string backend_reason(c10::string_view backend, const Problem& pb, c10::Device device) {
  const std::string name(backend);
  if (device.is_cpu()) {
    return name == "cpu" || name == "auto"
               ? ""
               : "cannot run on CPU tensors; backends for cpu: ['cpu'] (or 'auto')";
  }
  if (!device.is_cuda() || cuda_hooks().reason == nullptr) {
    std::ostringstream os;
    os << "no kernel for device " << device << " in this build";
    return os.str();
  }
  if (name == "auto") return "";
  if (name == "cpu") return "cannot run on CUDA tensors (only on CPU tensors)";
  return cuda_hooks().reason(name, pb, device.index());
}

std::string select_backend(const Problem& pb, c10::Device device) {
  if (device.is_cpu()) return "cpu";
  TORCH_CHECK(device.is_cuda() && cuda_hooks().select != nullptr,
              "ms_deform_attn: no kernel for device ", device, " in this build");
  return cuda_hooks().select(pb, device.index());
}

}  // namespace msda
