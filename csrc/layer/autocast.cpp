// Autocast kernels: under torch.autocast the operator takes the value as it
// comes (the projection that made it already ran in the autocast dtype) and
// sampling locations / attention weights in float32, whatever dtype they
// arrive in. Any mix of input dtypes a model produces under autocast is
// thereby one the kernels accept, and locations keep fp32 precision. Part of
// the version-bound layer (autograd.cpp says what that is).
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "calls.h"

namespace msda {
namespace {

at::Tensor to_fp32(const at::Tensor& t) {
  return (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16) ? t.to(at::kFloat) : t;
}

template <c10::DispatchKey key>
at::Tensor forward_autocast(const at::Tensor& value, const at::Tensor& spatial_shapes,
                            const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                            const at::Tensor& attention_weights, c10::string_view backend,
                            std::optional<bool> deterministic,
                            at::OptionalIntArrayRef spatial_shapes_list) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  return call_forward(value, spatial_shapes, level_start_index, to_fp32(sampling_locations),
                      to_fp32(attention_weights), backend, deterministic, spatial_shapes_list);
}

// _linear as torch's linear runs under autocast: every floating argument
// but fp64 in the autocast dtype, the parameters' casts cached.
template <c10::DispatchKey key, c10::DeviceType device>
at::Tensor linear_autocast(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(key);
  const auto t = at::autocast::get_lower_precision_fp_from_device_type(device);
  return call_linear(at::autocast::cached_cast(t, input, device),
                     at::autocast::cached_cast(t, weight, device),
                     at::autocast::cached_cast(t, bias, device));
}

}  // namespace
}  // namespace msda

TORCH_LIBRARY_IMPL(ms_deform_attn, AutocastCUDA, m) {
  m.impl("ms_deform_attn", &msda::forward_autocast<c10::DispatchKey::AutocastCUDA>);
  m.impl("_linear", &msda::linear_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>);
}

TORCH_LIBRARY_IMPL(ms_deform_attn, AutocastCPU, m) {
  m.impl("ms_deform_attn", &msda::forward_autocast<c10::DispatchKey::AutocastCPU>);
  m.impl("_linear", &msda::linear_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>);
}
