// CPU kernels of the operator: validation, allocation, parallel loop
// (torch's parallel_for, through the stable ABI: torch's own intra-op
// threads).

#include "../operator/backend_queries.h"
#include "../binding/kernel_table.h"
#include "../operator/output.h"
#include "../operator/validation.h"
#include "kernels.h"

namespace msda {
namespace {

Tensor forward_cpu(const Tensor& value, const Tensor& spatial_shapes,
                       const Tensor& level_start_index, const Tensor& sampling_locations,
                       const Tensor& attention_weights, std::string backend,
                       std::optional<bool> /*deterministic: the forward always is*/,
                       IntListOpt spatial_shapes_list) {
  const Prepared in = prepare_inputs(value, spatial_shapes, level_start_index,
                                     sampling_locations, attention_weights, backend,
                                     spatial_shapes_list);
  // Raises where the backend cannot run.
  plan_forward_for(forward_problem(in.pb, in.value.data_ptr(), /*fused=*/false), in.device,
                   backend);
  const auto& pb = in.pb;
  auto out = new_output({pb.N, pb.Lq, pb.M * pb.D}, in.value_dtype, in.device);
  const int64_t groups = pb.N * pb.Lq * pb.M;
  if (groups == 0) return out;
  ForwardParams p;
  set_inputs(p, in);
  p.out = out.data_ptr();
  // About 16k multiply-adds per grain.
  const int64_t grain = std::max<int64_t>(1, 16384 / (4 * pb.L * pb.P * pb.D));
  parallel_for(0, groups, grain, [&](int64_t b, int64_t e) { cpu::forward_range(p, b, e); });
  return out;
}

std::tuple<Tensor, Tensor, Tensor> backward_cpu(
    const Tensor& grad_output, const Tensor& value, const Tensor& spatial_shapes,
    const Tensor& level_start_index, const Tensor& sampling_locations,
    const Tensor& attention_weights, bool /*deterministic*/) {
  // Always deterministic: each (n, m) slice of grad_value is accumulated by
  // one thread, in query order, whatever the number of threads.
  const Prepared in = prepare_inputs(value, spatial_shapes, level_start_index,
                                     sampling_locations, attention_weights);
  const auto& pb = in.pb;
  check_grad_output(grad_output, in);
  const Tensor gout = make_contiguous(grad_output);
  const auto acc_type = in.value_dtype == kDouble ? kDouble : kFloat;
  const Device dev = in.device;
  auto grad_value_acc = value_shaped(pb, acc_type, dev, /*zeroed=*/true);
  auto grad_loc = new_output(in.loc.sizes(), in.loc_dtype, dev);
  auto grad_attn = new_output(in.attn.sizes(), in.loc_dtype, dev);
  if (pb.N * pb.Lq * pb.M > 0) {
    BackwardParams p;
    set_inputs(p, in);
    p.grad_out = gout.data_ptr();
    p.grad_value_acc = grad_value_acc.data_ptr();
    p.grad_loc = grad_loc.data_ptr();
    p.grad_attn = grad_attn.data_ptr();
    parallel_for(0, pb.N * pb.M, 1, [&](int64_t b, int64_t e) { cpu::backward_range(p, b, e); });
  }
  return {to(grad_value_acc, in.value_dtype), to(grad_loc, in.loc_dtype_in),
          to(grad_attn, in.attn_dtype_in)};
}

// _column_sum on the CPU: ATen's sum over the rows.
Tensor column_sum_cpu(const Tensor& grad) {
  const ColumnSumSizes z = check_column_sum(grad);
  return torch::stable::sum(reshape(grad, {z.rows, z.cols}), std::vector<int64_t>{0});
}

constexpr KernelEntry kKernels[] = {
    MSDA_KERNEL(column_sum_cpu, "CPU", "_column_sum", &column_sum_cpu),
    MSDA_KERNEL(forward_cpu, "CPU", "ms_deform_attn", &forward_cpu),
    MSDA_KERNEL(backward_cpu, "CPU", "_ms_deform_attn_backward", &backward_cpu),
};

}  // namespace

KernelTable cpu_kernels() { return kKernels; }

}  // namespace msda
