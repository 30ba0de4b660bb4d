// The operator's schemas and the backend queries. The kernels are tables
// per dispatch key in cpu/, cuda/ and fused.cpp (_linear's forward,
// aten::linear, here), registered by the version-bound layer or by
// registration.cpp; autograd, autocast and the public C++ API are the
// layer's (csrc/layer/). All of it through
// LibTorch's stable ABI (tensor.h).

#include "backend_queries.h"
#include "cuda_archs.h"
#include "../binding/kernel_table.h"
#include "../plan/backward_plan.h"
#include "ms_deform_attn/version.h"
#include "validation.h"

namespace msda {

namespace {

// A device described by the caller, [major, minor, sms, smem_optin,
// smem_per_sm, smem_reserved] (DeviceInfo's fields): the queries' way to ask
// the planners about a device that is not there.
std::optional<DeviceInfo> described_device(const IntListOpt& device) {
  if (!device.has_value()) return std::nullopt;
  MSDA_CHECK(device->size() == 6, "ms_deform_attn: device must be [major, minor, sms, "
              "smem_optin, smem_per_sm, smem_reserved], got ", device->size(), " numbers");
  const auto& v = *device;
  DeviceInfo d;
  d.major = static_cast<int>(v[0]);
  d.minor = static_cast<int>(v[1]);
  d.sms = static_cast<int>(v[2]);
  d.smem_optin = v[3];
  d.smem_per_sm = v[4];
  d.smem_reserved = v[5];
  return d;
}

// The queries validate the inputs (no copies) and ask the planners.
ForwardProblem checked_problem(const Tensor& value, const Tensor& spatial_shapes,
                               const Tensor& level_start_index,
                               const Tensor& sampling_locations,
                               const Tensor& attention_weights, std::string_view backend,
                               const IntListOpt& spatial_shapes_list, bool fused = false) {
  const Checked c = check_inputs(value, spatial_shapes, level_start_index, sampling_locations,
                                 attention_weights, backend, spatial_shapes_list);
  return forward_problem(c.pb, value.data_ptr(), fused);
}

// The forward's plan for these inputs (plan/forward_plan.h), on value's
// device or on the one `device` describes, through the operator's own path
// (plan_forward_for: MS_DEFORM_ATTN_BACKEND overrides "auto"). The fields
// as the schema names them, the backend first (the C++ API's select_backend
// reads that one field).
using ForwardPlanFields = std::tuple<std::string, bool, bool, int64_t, int64_t, int64_t, int64_t,
                                     bool, int64_t, int64_t, int64_t, int64_t, int64_t>;
ForwardPlanFields forward_plan(const Tensor& value, const Tensor& spatial_shapes,
                               const Tensor& level_start_index, const Tensor& sampling_locations,
                               const Tensor& attention_weights,
                               const IntListOpt& spatial_shapes_list, bool fused,
                               std::string_view backend, const IntListOpt& device) {
  const ForwardProblem p = checked_problem(value, spatial_shapes, level_start_index,
                                           sampling_locations, attention_weights, backend,
                                           spatial_shapes_list, fused);
  const ForwardPlan f = plan_forward_for(p, value.device(), backend, described_device(device));
  return {backend_name(f.backend), f.composite, f.copy_value, f.vec, f.lanes, f.threads,
          f.split, f.one_level, f.blocks_per_head, f.blocks, f.resident, f.smem_budget, f.workspace};
}

std::string reason(const Tensor& value, const Tensor& spatial_shapes,
                   const Tensor& level_start_index, const Tensor& sampling_locations,
                   const Tensor& attention_weights, std::string_view backend,
                   const IntListOpt& spatial_shapes_list) {
  const ForwardProblem p = checked_problem(value, spatial_shapes, level_start_index,
                                           sampling_locations, attention_weights, backend,
                                           spatial_shapes_list);
  return backend_reason(backend, p, value.device());
}

// The CUDA backward's plan for these inputs (plan/backward_plan.h) through
// the backward's own path (plan_backward_for: grad_value "auto" takes
// MS_DEFORM_ATTN_GRAD_VALUE), on the device `device` describes, else
// value's CUDA device, else an H100 (DeviceInfo's defaults); `sms` > 0
// replaces its SM count. grad_output is taken as contiguous and 32-byte
// aligned, as autograd hands it over.
using BackwardPlanFields =
    std::tuple<std::string, std::string, int64_t, std::string, int64_t, bool, bool, bool>;
BackwardPlanFields backward_plan(const Tensor& value, const Tensor& spatial_shapes,
                                 const Tensor& level_start_index,
                                 const Tensor& sampling_locations,
                                 const Tensor& attention_weights, bool fused, bool deterministic,
                                 std::string_view grad_value, int64_t sms,
                                 const IntListOpt& device) {
  const Checked c = check_inputs(value, spatial_shapes, level_start_index, sampling_locations,
                                 attention_weights, "auto", std::nullopt);
  BackwardProblem p = backward_problem(c.pb, value.data_ptr(), nullptr, fused);
  p.grad_out_align = 32;
  std::optional<DeviceInfo> d = described_device(device);
  if (sms > 0) {
    if (!d) d = value.is_cuda() ? cuda_device_info(value.get_device_index()) : DeviceInfo{};
    if (d) d->sms = static_cast<int>(sms);
  }
  const BackwardPlan b = plan_backward_for(p, value.device(), deterministic, grad_value, d);
  return {grad_value_name(b.grad_value), dots_name(b.dots), b.vec, gather_name(b.gather),
          b.gather_vec, b.stage, b.self_records, b.composite};
}

// _linear's forward on every device: torch's linear. What differs from it is
// its autograd (csrc/layer/autograd.cpp), whose bias gradient
// is _column_sum.
Tensor linear(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias) {
  return call_op("aten::linear", "", input, weight, bias);
}

// Whether this build has the CUDA kernels (setup.py defines MSDA_WITH_CUDA).
bool built_with_cuda() {
#ifdef MSDA_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::string image_error(std::string_view archs, int64_t major, int64_t minor,
                        std::string_view device) {
  return kernel_image_error(std::string(archs), static_cast<int>(major), static_cast<int>(minor),
                            std::string(device));
}

constexpr KernelEntry kLinear[] = {
    MSDA_BOXED_KERNEL(linear_composite, "CompositeExplicitAutograd", "_linear", &linear),
};

}  // namespace

KernelTable linear_kernels() { return kLinear; }

}  // namespace msda

STABLE_TORCH_LIBRARY(ms_deform_attn, m) {
  m.def(
      "ms_deform_attn(Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
      "Tensor sampling_locations, Tensor attention_weights, str backend=\"auto\", "
      "bool? deterministic=None, int[]? spatial_shapes_list=None) -> Tensor");
  // The layer's raw outputs in: locations and softmax formed inside (fused.h).
  m.def(
      "ms_deform_attn_fused(Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
      "Tensor reference_points, Tensor sampling_offsets, Tensor attention_logits, "
      "str backend=\"auto\", bool? deterministic=None, int[]? spatial_shapes_list=None) -> Tensor");
  m.def(
      "_ms_deform_attn_backward(Tensor grad_output, Tensor value, Tensor spatial_shapes, "
      "Tensor level_start_index, Tensor sampling_locations, Tensor attention_weights, "
      "bool deterministic=False) -> (Tensor, Tensor, Tensor)");
  // The fused operator's backward (no reference points' gradient): grad of
  // value, sampling_offsets, attention_logits.
  m.def(
      "_ms_deform_attn_fused_backward(Tensor grad_output, Tensor value, Tensor spatial_shapes, "
      "Tensor level_start_index, Tensor reference_points, Tensor sampling_offsets, "
      "Tensor attention_logits, bool deterministic=False) -> (Tensor, Tensor, Tensor)");
  // The same and the reference points' gradient last (ATen ops, fused.cpp).
  m.def(
      "_ms_deform_attn_fused_backward_ref(Tensor grad_output, Tensor value, "
      "Tensor spatial_shapes, Tensor level_start_index, Tensor reference_points, "
      "Tensor sampling_offsets, Tensor attention_logits, bool deterministic=False) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // The attention layers' linears: aten::linear, with a backward whose bias
  // gradient is _column_sum (torch's sum over the rows of a tall, narrow
  // gradient runs far below the copy rate). Not for general use.
  m.def("_linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  // grad summed over every dimension but the last, in grad's dtype.
  m.def("_column_sum(Tensor grad) -> Tensor");
  // Host-side queries: no tensors out, never traced.
  m.def("_available_backends(Device device) -> str[]");
  m.def(
      "_backend_reason(Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
      "Tensor sampling_locations, Tensor attention_weights, str backend, "
      "int[]? spatial_shapes_list=None) -> str");
  // The plans as structures, their fields named here (Python reads the
  // names from the schema).
  m.def(
      "_select_forward_plan(Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
      "Tensor sampling_locations, Tensor attention_weights, int[]? spatial_shapes_list=None, "
      "bool fused=False, str backend=\"auto\", int[]? device=None) -> (str backend, "
      "bool composite, bool copy_value, int vec, int lanes, int threads, int split, "
      "bool one_level, int blocks_per_head, int blocks, int resident, int smem_budget, int workspace)");
  m.def("_built_with_cuda() -> bool");
  // TORCH_CUDA_ARCH_LIST of the build ("" without CUDA kernels), and the
  // error a device of compute capability major.minor gets ("" if it runs them).
  m.def("_cuda_archs() -> str");
  m.def("_kernel_image_error(str archs, int major, int minor, str device) -> str");
  m.def(
      "_select_backward_plan(Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
      "Tensor sampling_locations, Tensor attention_weights, bool fused=False, "
      "bool deterministic=False, str grad_value=\"auto\", int sms=-1, int[]? device=None) -> "
      "(str grad_value, str dots, int vec, str gather, int gather_vec, bool stage, bool self_records, "
      "bool composite)");
}

// The host queries, for every device: CompositeExplicitAutograd kernels
// also serve calls without tensor arguments. The kernels of the tables
// (kernel_table.h) are registered by the layer or on request
// (registration.cpp).
STABLE_TORCH_LIBRARY_IMPL(ms_deform_attn, CompositeExplicitAutograd, m) {
  m.impl("_available_backends", TORCH_BOX(&msda::available_backends));
  m.impl("_backend_reason", TORCH_BOX(&msda::reason));
  m.impl("_select_forward_plan", TORCH_BOX(&msda::forward_plan));
  m.impl("_built_with_cuda", TORCH_BOX(&msda::built_with_cuda));
  m.impl("_cuda_archs", TORCH_BOX(&msda::cuda_archs));
  m.impl("_kernel_image_error", TORCH_BOX(&msda::image_error));
  m.impl("_select_backward_plan", TORCH_BOX(&msda::backward_plan));
}

// The library's version (MS_DEFORM_ATTN_VERSION of its build), for the
// loaders (the Python module) and C++ programs.
extern "C" const char* ms_deform_attn_library_version(void) { return MS_DEFORM_ATTN_VERSION; }
