// Autograd of the operators, registered on the Autograd dispatch key, so that
// Python, LibTorch programs and torch.compile / AOTInductor share one
// backward: the forward saves its five inputs (all the gradients need), the
// backward calls _ms_deform_attn_backward. That op's own Autograd kernel
// refuses double backward with a clear error. The fused operator's saves
// its raw inputs instead of the locations and weights.
//
// Part of the version-bound layer (with autocast.cpp and api.cpp): built
// against the LibTorch it runs with, into libms_deform_attn_torch.so for
// Python (setup.py) and into a C++ program by the CMake package, over the
// operator library, which it calls through the dispatcher only.
#include <ATen/Context.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "calls.h"

namespace msda {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The deterministic argument kept for the backward; None is decided when the
// backward runs, as torch's own ops do.
void save_deterministic(AutogradContext* ctx, std::optional<bool> deterministic) {
  ctx->saved_data["deterministic"] = deterministic.has_value() ? int64_t(*deterministic) : -1;
}

bool saved_deterministic(AutogradContext* ctx) {
  const int64_t det = ctx->saved_data["deterministic"].toInt();
  return det < 0 ? at::globalContext().deterministicAlgorithms() : det == 1;
}

class MSDAFunction : public torch::autograd::Function<MSDAFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& value,
                            const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                            const at::Tensor& sampling_locations,
                            const at::Tensor& attention_weights, c10::string_view backend,
                            std::optional<bool> deterministic,
                            at::OptionalIntArrayRef spatial_shapes_list) {
    at::AutoDispatchBelowADInplaceOrView below;
    at::Tensor out = call_forward(value, spatial_shapes, level_start_index, sampling_locations,
                                attention_weights, backend, deterministic, spatial_shapes_list);
    ctx->save_for_backward(
        {value, spatial_shapes, level_start_index, sampling_locations, attention_weights});
    save_deterministic(ctx, deterministic);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool deterministic = saved_deterministic(ctx);
    auto [grad_value, grad_loc, grad_attn] =
        call_backward(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4], deterministic);
    return {grad_value, at::Tensor(), at::Tensor(), grad_loc, grad_attn,
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The fused operator keeps its raw inputs (reference points, offsets and
// logits as the layer made them, 16-bit under autocast). Its backward,
// _ms_deform_attn_fused_backward, forms the locations and weights again
// (inside the CUDA kernels where they serve, as ATen tensors living only as
// long as the backward elsewhere); the reference points' gradient, when
// asked for, comes from the ATen composition.
class FusedFunction : public torch::autograd::Function<FusedFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& value,
                            const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                            const at::Tensor& reference_points,
                            const at::Tensor& sampling_offsets,
                            const at::Tensor& attention_logits, c10::string_view backend,
                            std::optional<bool> deterministic,
                            at::OptionalIntArrayRef spatial_shapes_list) {
    at::AutoDispatchBelowADInplaceOrView below;
    at::Tensor out = call_fused_forward(value, spatial_shapes, level_start_index,
                                        reference_points, sampling_offsets, attention_logits,
                                        backend, deterministic, spatial_shapes_list);
    ctx->save_for_backward({value, spatial_shapes, level_start_index, reference_points,
                            sampling_offsets, attention_logits});
    save_deterministic(ctx, deterministic);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool deterministic = saved_deterministic(ctx);
    const at::Tensor &value = saved[0], &shapes = saved[1], &start = saved[2], &ref = saved[3],
                     &off = saved[4], &logits = saved[5];
    at::Tensor grad_value, grad_ref, grad_off, grad_logits;
    if (ctx->needs_input_grad(3)) {
      // The reference points' gradient sums over heads and points: ATen ops.
      std::tie(grad_value, grad_off, grad_logits, grad_ref) = call_fused_backward_with_ref(
          grads[0], value, shapes, start, ref, off, logits, deterministic);
    } else {
      std::tie(grad_value, grad_off, grad_logits) =
          call_fused_backward(grads[0], value, shapes, start, ref, off, logits, deterministic);
    }
    return {grad_value, at::Tensor(), at::Tensor(), grad_ref, grad_off, grad_logits,
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The layers' linears (ms_deform_attn::_linear): torch's linear backward,
// but the bias gradient is _column_sum of the output gradient (one read of
// it at the copy rate). Saves the input and the weight, as torch's does.
class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
    at::AutoDispatchBelowADInplaceOrView below;
    at::Tensor out = call_linear(input, weight, bias);
    ctx->save_for_backward({input, weight});
    // Without a bias the node has two inputs: needs_input_grad(2) alone
    // would be out of range.
    ctx->saved_data["bias"] = bias.has_value() && bias->defined();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &grad = grads[0];
    at::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) grad_input = at::matmul(grad, weight);
    if (ctx->needs_input_grad(1)) {
      grad_weight = grad.reshape({-1, grad.size(-1)}).t().mm(input.reshape({-1, input.size(-1)}));
    }
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) {
      grad_bias = call_column_sum(grad);
    }
    return {grad_input, grad_weight, grad_bias};
  }
};

class MSDABackwardFunction : public torch::autograd::Function<MSDABackwardFunction> {
 public:
  static variable_list forward(AutogradContext*, const at::Tensor& grad_output,
                               const at::Tensor& value, const at::Tensor& spatial_shapes,
                               const at::Tensor& level_start_index,
                               const at::Tensor& sampling_locations,
                               const at::Tensor& attention_weights, bool deterministic) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [gv, gl, ga] = call_backward(grad_output, value, spatial_shapes, level_start_index,
                                    sampling_locations, attention_weights, deterministic);
    return {gv, gl, ga};
  }

  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false,
                "ms_deform_attn: double backward (differentiating the gradient) is not supported");
  }
};

at::Tensor forward_autograd(const at::Tensor& value, const at::Tensor& spatial_shapes,
                            const at::Tensor& level_start_index,
                            const at::Tensor& sampling_locations,
                            const at::Tensor& attention_weights, c10::string_view backend,
                            std::optional<bool> deterministic,
                            at::OptionalIntArrayRef spatial_shapes_list) {
  return MSDAFunction::apply(value, spatial_shapes, level_start_index, sampling_locations,
                             attention_weights, backend, deterministic, spatial_shapes_list);
}

at::Tensor fused_autograd(const at::Tensor& value, const at::Tensor& spatial_shapes,
                          const at::Tensor& level_start_index, const at::Tensor& reference_points,
                          const at::Tensor& sampling_offsets, const at::Tensor& attention_logits,
                          c10::string_view backend, std::optional<bool> deterministic,
                          at::OptionalIntArrayRef spatial_shapes_list) {
  return FusedFunction::apply(value, spatial_shapes, level_start_index, reference_points,
                              sampling_offsets, attention_logits, backend, deterministic,
                              spatial_shapes_list);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, bool deterministic) {
  auto r = MSDABackwardFunction::apply(grad_output, value, spatial_shapes, level_start_index,
                                       sampling_locations, attention_weights, deterministic);
  return {r[0], r[1], r[2]};
}

at::Tensor linear_autograd(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  return LinearFunction::apply(input, weight, bias);
}

}  // namespace
}  // namespace msda

TORCH_LIBRARY_IMPL(ms_deform_attn, Autograd, m) {
  m.impl("_linear", &msda::linear_autograd);
  m.impl("ms_deform_attn", &msda::forward_autograd);
  m.impl("ms_deform_attn_fused", &msda::fused_autograd);
  m.impl("_ms_deform_attn_backward", &msda::backward_autograd);
}
