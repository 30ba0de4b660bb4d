// CUDA kernels of the operator: validation, allocation and launch on the
// current stream of the value's device. Never synchronises with the host.
// Which forward backend runs, and how, is the forward planner's decision
// (../plan/forward_plan.h); the backward's, the backward planner's.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <array>
#include <atomic>

#include "../backend_queries.h"
#include "../cuda_archs.h"
#include "../fused.h"
#include "../output.h"
#include "../validation.h"
#include "backward/backward.h"
#include "kernel_image.h"
#include "launch.h"

namespace msda {
namespace {

// Before the first launch on a device: an error naming the architectures
// this build has and the one the device needs when it has no kernel the
// device runs, instead of CUDA's "no kernel image" at the first launch.
void require_kernel_image(c10::DeviceIndex device) {
  static std::array<std::atomic<bool>, 64> checked{};
  const bool cached = device >= 0 && device < static_cast<int>(checked.size());
  if (cached && checked[device].load(std::memory_order_relaxed)) return;
  const cudaError_t err = cuda::kernel_image_status();
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) {
    (void)cudaGetLastError();
    const cudaDeviceProp& pr = *at::cuda::getDeviceProperties(device);
    std::string msg = kernel_image_error(cuda_archs(), pr.major, pr.minor,
                                         "cuda:" + std::to_string(device) + " (" + pr.name + ")");
    TORCH_CHECK(false, msg.empty() ? "ms_deform_attn: the CUDA runtime finds no kernel image for "
                                     "this device (" + std::string(cudaGetErrorString(err)) + ")"
                                   : msg);
  }
  C10_CUDA_CHECK(err);
  if (cached) checked[device].store(true, std::memory_order_relaxed);
}

// t, or a copy of it whose data is aligned to `align` bytes.
at::Tensor aligned(at::Tensor t, int64_t align) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % align == 0 ? t : t.clone();
}

// Locations are read as (x, y) pairs with one vector load: keep them aligned.
at::Tensor aligned_pairs(at::Tensor t) { return aligned(t, 2 * t.element_size()); }

// The launcher of each backend with a CUDA kernel.
cudaError_t launch(const ForwardParams& p, cudaStream_t stream) {
  switch (p.plan.backend) {
    case ForwardBackend::baseline: return cuda::baseline_forward(p, stream);
    case ForwardBackend::blocked: return cuda::blocked_forward(p, stream);
    case ForwardBackend::persistent: return cuda::persistent_forward(p, stream);
    case ForwardBackend::cluster: return cuda::cluster_forward(p, stream);
    case ForwardBackend::tma: return cuda::tma_forward(p, stream);
    case ForwardBackend::cpu: break;
  }
  return cudaErrorInvalidValue;
}

// The forward's plan for the prepared inputs on value's device.
ForwardPlan plan_for(const Prepared& in, bool fused, c10::string_view backend) {
  return forward_plan(forward_problem(in.pb, in.value.data_ptr(), fused), in.value.device(),
                      backend);
}

// Allocates the output and launches the plan's kernel on the prepared
// inputs; with `ref` set (ms_deform_attn_fused, plan not composite) loc and
// attn hold offsets and logits and ref the float32 reference points.
at::Tensor launch_forward(Prepared& in, const ForwardPlan& plan, const float* ref = nullptr,
                          int ref_dim = 0) {
  const auto& pb = in.pb;
  auto out = new_output({pb.N, pb.Lq, pb.M * pb.D}, in.value.options());
  if (out.numel() == 0) return out;
  in.loc = aligned_pairs(in.loc);
  if (plan.copy_value) in.value = in.value.clone();
  ForwardParams p;
  set_inputs(p, in);
  p.out = out.data_ptr();
  p.ref = ref;
  p.ref_dim = ref_dim;
  p.plan = plan;
  p.vec = plan.vec;
  at::Tensor workspace;
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (plan.workspace > 0) {
    // Zeroed by a memset on the stream (graph-capturable; compute-sanitizer's
    // initcheck sees it, unlike a fill by a kernel it does not instrument).
    workspace = at::empty({plan.workspace}, in.value.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
    C10_CUDA_CHECK(cudaMemsetAsync(p.workspace, 0, plan.workspace, stream));
  }
  C10_CUDA_CHECK(launch(p, stream));
  return out;
}

at::Tensor forward_cuda(const at::Tensor& value, const at::Tensor& spatial_shapes,
                        const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                        const at::Tensor& attention_weights, c10::string_view backend,
                        std::optional<bool> /*deterministic: the forward always is*/,
                        at::OptionalIntArrayRef spatial_shapes_list) {
  Prepared in = prepare_inputs(value, spatial_shapes, level_start_index, sampling_locations,
                               attention_weights, backend, spatial_shapes_list);
  const c10::cuda::CUDAGuard guard(value.device());
  require_kernel_image(value.device().index());
  return launch_forward(in, plan_for(in, /*fused=*/false, backend));
}

// The fused operator's inputs as the kernels take them: offsets and logits
// (N, Lq, M, L, P) in one dtype (value's or float32), validated as the
// locations and weights would be; reference points as float32.
struct FusedPrepared {
  FusedSizes s;
  Prepared in;
  at::Tensor ref;
};

FusedPrepared prepare_fused(const FusedSizes& s, const at::Tensor& value,
                            const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                            const at::Tensor& reference_points, const at::Tensor& sampling_offsets,
                            const at::Tensor& attention_logits, c10::string_view backend = "auto",
                            at::OptionalIntArrayRef spatial_shapes_list = std::nullopt) {
  const auto vt = value.scalar_type();
  const bool as_is = sampling_offsets.scalar_type() == attention_logits.scalar_type() &&
                     (sampling_offsets.scalar_type() == vt ||
                      sampling_offsets.scalar_type() == at::kFloat);
  const at::Tensor off = as_is ? sampling_offsets : sampling_offsets.to(at::kFloat);
  const at::Tensor logits = (as_is ? attention_logits : attention_logits.to(at::kFloat))
                                .reshape({s.N, s.Lq, s.M, s.L, s.P});
  return {s,
          prepare_inputs(value, spatial_shapes, level_start_index, off, logits, backend,
                         spatial_shapes_list),
          reference_points.to(at::kFloat).contiguous()};
}

// ms_deform_attn_fused on CUDA: the baseline and blocked kernels form the
// locations and the softmax themselves (nothing of size N x Lq x M x L x P
// is made); where the plan says composite (other backends, fp64 values) the
// composite (fused.cpp) serves it.
at::Tensor fused_forward_cuda(const at::Tensor& value, const at::Tensor& spatial_shapes,
                              const at::Tensor& level_start_index,
                              const at::Tensor& reference_points,
                              const at::Tensor& sampling_offsets,
                              const at::Tensor& attention_logits, c10::string_view backend,
                              std::optional<bool> deterministic,
                              at::OptionalIntArrayRef spatial_shapes_list) {
  const FusedSizes s = check_fused_inputs(value, spatial_shapes, reference_points,
                                          sampling_offsets, attention_logits);
  auto composite = [&] {
    return fused_forward_formed(s, value, spatial_shapes, level_start_index, reference_points,
                                sampling_offsets, attention_logits, backend, deterministic,
                                spatial_shapes_list);
  };
  FusedPrepared f = prepare_fused(s, value, spatial_shapes, level_start_index, reference_points,
                                  sampling_offsets, attention_logits, backend, spatial_shapes_list);
  const c10::cuda::CUDAGuard guard(value.device());
  const ForwardPlan plan = plan_for(f.in, /*fused=*/true, backend);
  if (plan.composite) return composite();
  require_kernel_image(value.device().index());
  return launch_forward(f.in, plan, f.ref.data_ptr<float>(), s.boxes ? 4 : 2);
}

// The backward's parameters for the prepared inputs: grad_output checked
// against them (its contiguous copy kept in `gout`), locations aligned.
BackwardParams backward_params(Prepared& in, const at::Tensor& grad_output, const at::Tensor& value,
                               at::Tensor& gout) {
  check_grad_output(grad_output, in.pb, value);
  gout = grad_output.contiguous();
  in.loc = aligned_pairs(in.loc);
  BackwardParams p;
  set_inputs(p, in);
  p.grad_out = gout.data_ptr();
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, bool deterministic) {
  Prepared in = prepare_inputs(value, spatial_shapes, level_start_index, sampling_locations,
                               attention_weights);
  const c10::cuda::CUDAGuard guard(value.device());
  require_kernel_image(value.device().index());
  auto grad_loc = new_output(in.loc.sizes(), in.loc.options());
  auto grad_attn = new_output(in.attn.sizes(), in.attn.options());
  at::Tensor gout;
  BackwardParams p = backward_params(in, grad_output, value, gout);
  p.grad_loc = grad_loc.data_ptr();
  p.grad_attn = grad_attn.data_ptr();
  p.plan = cuda::plan_for(p, /*fused=*/false, deterministic);
  at::Tensor grad_value = cuda::run_backward(p, in, at::cuda::getCurrentCUDAStream());
  return {grad_value, grad_loc.to(in.loc_dtype_in), grad_attn.to(in.attn_dtype_in)};
}

// The fused operator's backward on CUDA (without the reference points'
// gradient): its kernels form the locations and the softmax themselves and
// write the offsets' and logits' gradients (in the offsets' dtype from the
// tensor-core dots, else float32, then converted). Where the plan says so
// (fp64 values, rows the FFMA kernel cannot take in one vectorised pass) the
// composite (fused.cpp) serves it.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& reference_points,
    const at::Tensor& sampling_offsets, const at::Tensor& attention_logits, bool deterministic) {
  const FusedSizes s = check_fused_inputs(value, spatial_shapes, reference_points,
                                          sampling_offsets, attention_logits);
  auto composite = [&] {
    return fused_input_grads_formed(s, grad_output, value, spatial_shapes, level_start_index,
                                    reference_points, sampling_offsets, attention_logits,
                                    deterministic);
  };
  FusedPrepared f = prepare_fused(s, value, spatial_shapes, level_start_index, reference_points,
                                  sampling_offsets, attention_logits);
  Prepared& in = f.in;
  const c10::cuda::CUDAGuard guard(value.device());
  require_kernel_image(value.device().index());
  const auto& pb = in.pb;
  at::Tensor gout;
  BackwardParams p = backward_params(in, grad_output, value, gout);
  p.plan = cuda::plan_for(p, /*fused=*/true, deterministic);
  if (p.plan.composite) return composite();
  const auto grads = p.plan.dots != DotsKernel::ffma ? in.loc.options() : in.loc.options().dtype(at::kFloat);
  auto grad_off = new_output(in.loc.sizes(), grads);
  auto grad_logits = new_output(in.attn.sizes(), grads);
  p.grad_loc = grad_off.data_ptr();
  p.grad_attn = grad_logits.data_ptr();
  p.ref = f.ref.data_ptr<float>();
  p.ref_dim = s.boxes ? 4 : 2;
  at::Tensor row_stats;
  if (p.plan.deterministic()) {
    row_stats = at::empty({pb.N * pb.Lq * pb.M, 2}, in.loc.options().dtype(at::kFloat));
    p.row_stats = row_stats.data_ptr<float>();
  }
  at::Tensor grad_value = cuda::run_backward(p, in, at::cuda::getCurrentCUDAStream());
  return {grad_value, grad_off.to(sampling_offsets.scalar_type()),
          grad_logits.to(attention_logits.scalar_type()).view(attention_logits.sizes())};
}

// _column_sum on CUDA: column_sum.cu's two passes (partial sums of row
// chunks, then their totals in chunk order).
at::Tensor column_sum_cuda(const at::Tensor& grad) {
  const ColumnSumSizes z = check_column_sum(grad);
  const at::Tensor g = grad.contiguous();
  at::Tensor out = at::empty({z.cols}, g.options());
  if (z.cols == 0) return out;
  const c10::cuda::CUDAGuard guard(g.device());
  require_kernel_image(g.device().index());
  cuda::ColumnSumParams p;
  p.dtype = to_dtype(g.scalar_type());
  p.grad = g.data_ptr();
  p.rows = z.rows;
  p.cols = z.cols;
  const int64_t elem = g.element_size();
  p.vec = cuda::pick_vec(z.cols, elem, static_cast<int>(16 / elem), {p.grad});
  p.shape = cuda::column_sum_shape(z.rows, z.cols, p.vec,
                                   at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  const auto acc = g.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor partial = at::empty({p.shape.chunks, z.cols}, g.options().dtype(acc));
  p.partial = partial.data_ptr();
  p.out = out.data_ptr();
  C10_CUDA_CHECK(cuda::column_sum(p, at::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace
}  // namespace msda

TORCH_LIBRARY_IMPL(ms_deform_attn, CUDA, m) {
  m.impl("_column_sum", &msda::column_sum_cuda);
  m.impl("ms_deform_attn", &msda::forward_cuda);
  m.impl("_ms_deform_attn_backward", &msda::backward_cuda);
  m.impl("ms_deform_attn_fused", &msda::fused_forward_cuda);
  m.impl("_ms_deform_attn_fused_backward", &msda::fused_backward_cuda);
}
