// Calls of the operator through the dispatcher (every registered kernel:
// autograd, autocast, CPU, CUDA), for the code that wraps it: the autograd
// and autocast kernels and the public C++ API. Defined in ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/OptionalArrayRef.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace msda {

at::Tensor call_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                        const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                        const at::Tensor& attention_weights, c10::string_view backend,
                        std::optional<bool> deterministic,
                        at::OptionalIntArrayRef spatial_shapes_list);

at::Tensor call_fused_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                              const at::Tensor& level_start_index,
                              const at::Tensor& reference_points,
                              const at::Tensor& sampling_offsets,
                              const at::Tensor& attention_logits, c10::string_view backend,
                              std::optional<bool> deterministic,
                              at::OptionalIntArrayRef spatial_shapes_list);

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_backward(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, bool deterministic);

// The fused operator's backward without the reference points' gradient:
// grad_value, grad_sampling_offsets, grad_attention_logits.
std::tuple<at::Tensor, at::Tensor, at::Tensor> call_fused_backward(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& reference_points,
    const at::Tensor& sampling_offsets, const at::Tensor& attention_logits, bool deterministic);

// ms_deform_attn::_linear (at::linear; its autograd's bias gradient is
// _column_sum) and _column_sum.
at::Tensor call_linear(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias);
at::Tensor call_column_sum(const at::Tensor& grad);

}  // namespace msda
