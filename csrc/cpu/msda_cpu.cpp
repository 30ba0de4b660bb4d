// CPU kernels of the operator: validation, allocation, parallel loop
// (at::parallel_for: OpenMP threads when the build has -fopenmp, setup.py).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../backend_queries.h"
#include "../output.h"
#include "../validation.h"
#include "kernels.h"

namespace msda {
namespace {

at::Tensor forward_cpu(const at::Tensor& value, const at::Tensor& spatial_shapes,
                       const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                       const at::Tensor& attention_weights, c10::string_view backend,
                       std::optional<bool> /*deterministic: the forward always is*/,
                       at::OptionalIntArrayRef spatial_shapes_list) {
  const Prepared in = prepare_inputs(value, spatial_shapes, level_start_index,
                                     sampling_locations, attention_weights, backend,
                                     spatial_shapes_list);
  // Raises where the backend cannot run.
  forward_plan(forward_problem(in.pb, in.value.data_ptr(), /*fused=*/false), value.device(), backend);
  const auto& pb = in.pb;
  auto out = new_output({pb.N, pb.Lq, pb.M * pb.D}, in.value.options());
  const int64_t groups = pb.N * pb.Lq * pb.M;
  if (groups == 0) return out;
  ForwardParams p;
  set_inputs(p, in);
  p.out = out.data_ptr();
  // About 16k multiply-adds per grain.
  const int64_t grain = std::max<int64_t>(1, 16384 / (4 * pb.L * pb.P * pb.D));
  at::parallel_for(0, groups, grain,
                   [&](int64_t b, int64_t e) { cpu::forward_range(p, b, e); });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, bool /*deterministic*/) {
  // Always deterministic: each (n, m) slice of grad_value is accumulated by
  // one thread, in query order, whatever the number of threads.
  const Prepared in = prepare_inputs(value, spatial_shapes, level_start_index,
                                     sampling_locations, attention_weights);
  const auto& pb = in.pb;
  check_grad_output(grad_output, pb, value);
  const at::Tensor gout = grad_output.contiguous();
  const auto acc_type = in.value.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto grad_value_acc = value_shaped(pb, in.value.options().dtype(acc_type), /*zeroed=*/true);
  auto grad_loc = new_output(in.loc.sizes(), in.loc.options());
  auto grad_attn = new_output(in.attn.sizes(), in.attn.options());
  if (pb.N * pb.Lq * pb.M > 0) {
    BackwardParams p;
    set_inputs(p, in);
    p.grad_out = gout.data_ptr();
    p.grad_value_acc = grad_value_acc.data_ptr();
    p.grad_loc = grad_loc.data_ptr();
    p.grad_attn = grad_attn.data_ptr();
    at::parallel_for(0, pb.N * pb.M, 1,
                     [&](int64_t b, int64_t e) { cpu::backward_range(p, b, e); });
  }
  return {grad_value_acc.to(in.value.scalar_type()), grad_loc.to(in.loc_dtype_in),
          grad_attn.to(in.attn_dtype_in)};
}

// _column_sum on the CPU: ATen's sum over the rows.
at::Tensor column_sum_cpu(const at::Tensor& grad) {
  const ColumnSumSizes z = check_column_sum(grad);
  return grad.reshape({z.rows, z.cols}).sum(0);
}

}  // namespace
}  // namespace msda

TORCH_LIBRARY_IMPL(ms_deform_attn, CPU, m) {
  m.impl("_column_sum", &msda::column_sum_cpu);
  m.impl("ms_deform_attn", &msda::forward_cpu);
  m.impl("_ms_deform_attn_backward", &msda::backward_cpu);
}
