// Operator schemas of the ms_deform_attn library, and the small device-agnostic
// helpers (backend listing and "auto" resolution). Kernels are registered per
// dispatch key in cpu/ and cuda/.
#include <Python.h>
#include <torch/library.h>

#include "prepare.h"

extern "C" {
// Importing ms_deform_attn._C loads this library, which runs the TORCH_LIBRARY
// registrations below. The module itself is empty.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace msda {
namespace {

std::vector<std::string> available_backends(c10::Device device) {
  if (device.is_cpu()) return {"cpu"};
  if (device.is_cuda()) {
    auto& hooks = cuda_hooks();
    if (hooks.available == nullptr) return {};  // built without CUDA
    return hooks.available(device.has_index() ? device.index() : -1);
  }
  return {};
}

std::string select_backend(const at::Tensor& value, const at::Tensor& spatial_shapes,
                           const at::Tensor& level_start_index,
                           const at::Tensor& sampling_locations,
                           const at::Tensor& attention_weights,
                           at::OptionalIntArrayRef spatial_shapes_list) {
  const Prepared in = prepare_inputs(value, spatial_shapes, level_start_index,
                                     sampling_locations, attention_weights, spatial_shapes_list);
  if (value.is_cpu()) return "cpu";
  auto& hooks = cuda_hooks();
  TORCH_CHECK(value.is_cuda() && hooks.select != nullptr,
              "ms_deform_attn: no kernel for device ", value.device());
  return hooks.select(in.pb, value.device().index());
}

std::string backend_reason(const at::Tensor& value, const at::Tensor& spatial_shapes,
                           const at::Tensor& level_start_index,
                           const at::Tensor& sampling_locations,
                           const at::Tensor& attention_weights, c10::string_view backend,
                           at::OptionalIntArrayRef spatial_shapes_list) {
  const Prepared in = prepare_inputs(value, spatial_shapes, level_start_index,
                                     sampling_locations, attention_weights, spatial_shapes_list);
  const std::string name(backend);
  if (value.is_cpu()) {
    return name == "cpu" || name == "auto" ? "" : "cannot run on CPU tensors (only 'cpu' can)";
  }
  auto& hooks = cuda_hooks();
  if (!value.is_cuda() || hooks.reason == nullptr) return "no kernel for this device";
  if (name == "auto") return "";
  return hooks.reason(name, in.pb, value.device().index());
}

}  // namespace
}  // namespace msda

TORCH_LIBRARY(ms_deform_attn, m) {
  m.def(
      "ms_deform_attn(Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
      "Tensor sampling_locations, Tensor attention_weights, str backend=\"auto\", "
      "bool? deterministic=None, int[]? spatial_shapes_list=None) -> Tensor");
  m.def(
      "_ms_deform_attn_backward(Tensor grad_output, Tensor value, Tensor spatial_shapes, "
      "Tensor level_start_index, Tensor sampling_locations, Tensor attention_weights, "
      "bool deterministic=False) -> (Tensor, Tensor, Tensor)");
  // Host-side helpers: no tensors out, never traced.
  m.def("_available_backends(Device device) -> str[]", &msda::available_backends);
  m.def(
      "_select_backend(Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
      "Tensor sampling_locations, Tensor attention_weights, int[]? spatial_shapes_list=None) -> str",
      &msda::select_backend);
  m.def(
      "_backend_reason(Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
      "Tensor sampling_locations, Tensor attention_weights, str backend, "
      "int[]? spatial_shapes_list=None) -> str",
      &msda::backend_reason);
}
