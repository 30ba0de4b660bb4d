// ms_deform_attn::_linear, the attention layers' linears: at::linear on
// every device. What differs from torch's linear is its autograd
// (autograd/autograd.cpp): the bias gradient comes from _column_sum, not
// from torch's sum over the rows.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace msda {
namespace {

at::Tensor linear_composite(const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
  return at::linear(input, weight, bias);
}

}  // namespace
}  // namespace msda

TORCH_LIBRARY_IMPL(ms_deform_attn, CompositeExplicitAutograd, m) {
  m.impl("_linear", &msda::linear_composite);
}
