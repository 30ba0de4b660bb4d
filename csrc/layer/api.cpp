// The public C++ API (ms_deform_attn/ms_deform_attn.h): the operators and the
// backend queries through the dispatcher, so that a LibTorch program gets
// every registered kernel (autograd, autocast, CPU, CUDA). Part of the
// version-bound layer (autograd.cpp says what that is).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/version.h>

#include "calls.h"
#include "ms_deform_attn/ms_deform_attn.h"

namespace ms_deform_attn {
namespace {

using ReasonSig = std::string(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, c10::string_view,
                              at::OptionalIntArrayRef);
using BackendsSig = std::vector<std::string>(c10::Device);

// The operator library is built on LibTorch's stable ABI, whose kernels
// raise std::runtime_error; the header promises c10::Error, as LibTorch's
// own functions raise: the same message, rethrown as one.
template <typename F>
auto c10_errors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace

at::Tensor ms_deform_attn(const at::Tensor& value, const at::Tensor& spatial_shapes,
                          const at::Tensor& level_start_index,
                          const at::Tensor& sampling_locations,
                          const at::Tensor& attention_weights, const std::string& backend,
                          std::optional<bool> deterministic,
                          at::OptionalIntArrayRef spatial_shapes_list) {
  return c10_errors([&] {
    return msda::call_forward(value, spatial_shapes, level_start_index, sampling_locations,
                              attention_weights, backend, deterministic, spatial_shapes_list);
  });
}

at::Tensor ms_deform_attn_fused(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                const at::Tensor& level_start_index,
                                const at::Tensor& reference_points,
                                const at::Tensor& sampling_offsets,
                                const at::Tensor& attention_logits, const std::string& backend,
                                std::optional<bool> deterministic,
                                at::OptionalIntArrayRef spatial_shapes_list) {
  return c10_errors([&] {
    return msda::call_fused_forward(value, spatial_shapes, level_start_index, reference_points,
                                    sampling_offsets, attention_logits, backend, deterministic,
                                    spatial_shapes_list);
  });
}

std::vector<std::string> available_backends(c10::Device device) {
  static const auto op = msda::typed_op<BackendsSig>("ms_deform_attn::_available_backends");
  return c10_errors([&] { return op.call(device); });
}

std::string select_backend(const at::Tensor& value, const at::Tensor& spatial_shapes,
                           const at::Tensor& level_start_index,
                           const at::Tensor& sampling_locations,
                           const at::Tensor& attention_weights,
                           at::OptionalIntArrayRef spatial_shapes_list) {
  // _select_forward_plan's first field is the backend (ops.cpp); called
  // boxed, so that only that one is read here, whatever fields follow.
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("ms_deform_attn::_select_forward_plan", "");
  return c10_errors([&] {
    torch::jit::Stack stack{value, spatial_shapes, level_start_index, sampling_locations,
                            attention_weights, c10::IValue(spatial_shapes_list), false,
                            std::string("auto"), c10::IValue()};
    op.callBoxed(&stack);
    return stack.at(0).toStringRef();
  });
}

std::string backend_reason(const std::string& backend, const at::Tensor& value,
                           const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                           const at::Tensor& sampling_locations,
                           const at::Tensor& attention_weights,
                           at::OptionalIntArrayRef spatial_shapes_list) {
  static const auto op = msda::typed_op<ReasonSig>("ms_deform_attn::_backend_reason");
  return c10_errors([&] {
    return op.call(value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights, backend, spatial_shapes_list);
  });
}

}  // namespace ms_deform_attn

// The torch release this layer was compiled against (the package checks it
// after loading the layer, ms_deform_attn/_layer.py).
#define MSDA_STR2(x) #x
#define MSDA_STR(x) MSDA_STR2(x)
extern "C" MS_DEFORM_ATTN_API const char* ms_deform_attn_torch_layer_built_for(void) {
  return MSDA_STR(TORCH_VERSION_MAJOR) "." MSDA_STR(TORCH_VERSION_MINOR);
}
