// Typed calls of the operators through the dispatcher (every registered
// kernel: autograd, autocast, CPU, CUDA), for the code that wraps them: the
// autograd and autocast kernels, the public C++ API and the fused
// operator's composite. Header-only: compiled against whichever LibTorch
// includes it.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/OptionalArrayRef.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace msda {

// The typed handle of operator `name` (each call below keeps its own in a
// static, so it is looked up once).
template <typename Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").template typed<Signature>();
}

using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, c10::string_view,
                              std::optional<bool>, at::OptionalIntArrayRef);
using BackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, bool);
using FusedForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   c10::string_view, std::optional<bool>, at::OptionalIntArrayRef);
using FusedBackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);
using FusedBackwardRefSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);
using LinearSig = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
using ColumnSumSig = at::Tensor(const at::Tensor&);

inline at::Tensor call_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                               const at::Tensor& level_start_index,
                               const at::Tensor& sampling_locations,
                               const at::Tensor& attention_weights, c10::string_view backend,
                               std::optional<bool> deterministic,
                               at::OptionalIntArrayRef spatial_shapes_list) {
  static const auto op = typed_op<ForwardSig>("ms_deform_attn::ms_deform_attn");
  return op.call(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                 backend, deterministic, spatial_shapes_list);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> call_backward(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, bool deterministic) {
  static const auto op = typed_op<BackwardSig>("ms_deform_attn::_ms_deform_attn_backward");
  return op.call(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                 attention_weights, deterministic);
}

inline at::Tensor call_fused_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                     const at::Tensor& level_start_index,
                                     const at::Tensor& reference_points,
                                     const at::Tensor& sampling_offsets,
                                     const at::Tensor& attention_logits, c10::string_view backend,
                                     std::optional<bool> deterministic,
                                     at::OptionalIntArrayRef spatial_shapes_list) {
  static const auto op = typed_op<FusedForwardSig>("ms_deform_attn::ms_deform_attn_fused");
  return op.call(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                 attention_logits, backend, deterministic, spatial_shapes_list);
}

// The fused operator's backward without the reference points' gradient:
// grad_value, grad_sampling_offsets, grad_attention_logits.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> call_fused_backward(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& reference_points,
    const at::Tensor& sampling_offsets, const at::Tensor& attention_logits, bool deterministic) {
  static const auto op =
      typed_op<FusedBackwardSig>("ms_deform_attn::_ms_deform_attn_fused_backward");
  return op.call(grad_output, value, spatial_shapes, level_start_index, reference_points,
                 sampling_offsets, attention_logits, deterministic);
}

// The same with the reference points' gradient last (formed by ATen ops).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> call_fused_backward_with_ref(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& reference_points,
    const at::Tensor& sampling_offsets, const at::Tensor& attention_logits, bool deterministic) {
  static const auto op =
      typed_op<FusedBackwardRefSig>("ms_deform_attn::_ms_deform_attn_fused_backward_ref");
  return op.call(grad_output, value, spatial_shapes, level_start_index, reference_points,
                 sampling_offsets, attention_logits, deterministic);
}

// ms_deform_attn::_linear (at::linear; its autograd's bias gradient is
// _column_sum) and _column_sum.
inline at::Tensor call_linear(const at::Tensor& input, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  static const auto op = typed_op<LinearSig>("ms_deform_attn::_linear");
  return op.call(input, weight, bias);
}

inline at::Tensor call_column_sum(const at::Tensor& grad) {
  static const auto op = typed_op<ColumnSumSig>("ms_deform_attn::_column_sum");
  return op.call(grad);
}

}  // namespace msda
