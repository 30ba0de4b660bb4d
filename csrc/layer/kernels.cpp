// The operator library's CPU, CUDA and composite kernels registered unboxed
// for this LibTorch (library_kernels.h says why): each takes ATen tensors,
// hands the library new handles to them and takes its results back. The
// CUDA ones only where the library has them (a CPU-only build answers CUDA
// tensors itself). _linear's forward is at::linear here.
//
// Part of the version-bound layer (autograd.cpp says what that is).
#include <ATen/core/Tensor.h>
#include <ATen/ops/linear.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "library_kernels.h"

namespace msda {
namespace {

using library::Call;
using library::Kernel;

// Kernel k on the tensors (in schema order) with the call's options; its
// NOut results.
template <size_t NOut, typename... T>
std::array<at::Tensor, NOut> run(Kernel k, Call call, const T&... tensors) {
  using torch::aot_inductor::new_tensor_handle;
  std::array<AtenTensorHandle, sizeof...(T)> in{new_tensor_handle(at::Tensor(tensors))...};
  std::array<at::Tensor, NOut> results;
  call.in = in.data();
  call.in_count = in.size();
  call.context = &results;
  call.take_results = [](void* context, const AtenTensorHandle* handles) {
    auto& r = *static_cast<std::array<at::Tensor, NOut>*>(context);
    for (size_t i = 0; i < NOut; ++i) {
      r[i] = *torch::aot_inductor::tensor_handle_to_tensor_pointer(handles[i]);
    }
  };
  library::run_kernel(k, call);
  return results;
}

Call options(c10::string_view backend, std::optional<bool> deterministic,
             at::OptionalIntArrayRef spatial_shapes_list) {
  Call c;
  c.backend = std::string_view(backend.data(), backend.size());
  c.deterministic = deterministic.has_value() ? int(*deterministic) : -1;
  if (spatial_shapes_list.has_value()) {
    c.shapes_list = spatial_shapes_list->data();
    c.shapes_list_len = static_cast<int64_t>(spatial_shapes_list->size());
  }
  return c;
}

Call options(bool deterministic) {
  Call c;
  c.deterministic = int(deterministic);
  return c;
}

template <size_t N>
auto as_tuple(std::array<at::Tensor, N>&& r) {
  return std::apply([](auto&&... t) { return std::make_tuple(std::move(t)...); }, std::move(r));
}

template <Kernel K>
at::Tensor forward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                   const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                   const at::Tensor& attention_weights, c10::string_view backend,
                   std::optional<bool> deterministic,
                   at::OptionalIntArrayRef spatial_shapes_list) {
  return run<1>(K, options(backend, deterministic, spatial_shapes_list), value, spatial_shapes,
                level_start_index, sampling_locations, attention_weights)[0];
}

template <Kernel K>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, bool deterministic) {
  return as_tuple(run<3>(K, options(deterministic), grad_output, value, spatial_shapes,
                         level_start_index, sampling_locations, attention_weights));
}

template <Kernel K>
at::Tensor fused_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                         const at::Tensor& level_start_index, const at::Tensor& reference_points,
                         const at::Tensor& sampling_offsets, const at::Tensor& attention_logits,
                         c10::string_view backend, std::optional<bool> deterministic,
                         at::OptionalIntArrayRef spatial_shapes_list) {
  return run<1>(K, options(backend, deterministic, spatial_shapes_list), value, spatial_shapes,
                level_start_index, reference_points, sampling_offsets, attention_logits)[0];
}

// The fused backward: grad of value, offsets, logits (and the reference
// points', NOut 4).
template <Kernel K, size_t NOut>
auto fused_backward(const at::Tensor& grad_output, const at::Tensor& value,
                    const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                    const at::Tensor& reference_points, const at::Tensor& sampling_offsets,
                    const at::Tensor& attention_logits, bool deterministic) {
  return as_tuple(run<NOut>(K, options(deterministic), grad_output, value, spatial_shapes,
                            level_start_index, reference_points, sampling_offsets,
                            attention_logits));
}

template <Kernel K>
at::Tensor column_sum(const at::Tensor& grad) {
  return run<1>(K, Call{}, grad)[0];
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  return at::linear(input, weight, bias);
}

}  // namespace
}  // namespace msda

TORCH_LIBRARY_IMPL(ms_deform_attn, CPU, m) {
  using msda::library::Kernel;
  m.impl("ms_deform_attn", TORCH_FN(msda::forward<Kernel::forward_cpu>));
  m.impl("_ms_deform_attn_backward", TORCH_FN(msda::backward<Kernel::backward_cpu>));
  m.impl("_column_sum", TORCH_FN(msda::column_sum<Kernel::column_sum_cpu>));
}

TORCH_LIBRARY_IMPL(ms_deform_attn, CUDA, m) {
  using msda::library::Kernel;
  if (!msda::library::has_kernel(Kernel::forward_cuda)) return;
  m.impl("ms_deform_attn", TORCH_FN(msda::forward<Kernel::forward_cuda>));
  m.impl("_ms_deform_attn_backward", TORCH_FN(msda::backward<Kernel::backward_cuda>));
  m.impl("_column_sum", TORCH_FN(msda::column_sum<Kernel::column_sum_cuda>));
  m.impl("ms_deform_attn_fused", TORCH_FN(msda::fused_forward<Kernel::fused_forward_cuda>));
  m.impl("_ms_deform_attn_fused_backward",
         TORCH_FN((msda::fused_backward<Kernel::fused_backward_cuda, 3>)));
}

TORCH_LIBRARY_IMPL(ms_deform_attn, CompositeExplicitAutograd, m) {
  using msda::library::Kernel;
  m.impl("_linear", TORCH_FN(msda::linear));
  m.impl("ms_deform_attn_fused", TORCH_FN(msda::fused_forward<Kernel::fused_forward_composite>));
  m.impl("_ms_deform_attn_fused_backward",
         TORCH_FN((msda::fused_backward<Kernel::fused_backward_composite, 3>)));
  m.impl("_ms_deform_attn_fused_backward_ref",
         TORCH_FN((msda::fused_backward<Kernel::fused_backward_ref_composite, 4>)));
}
