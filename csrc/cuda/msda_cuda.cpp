// CUDA kernels of the operator: validation, allocation and launch on the
// current stream of the value's device. Never synchronises with the host.
// Which forward backend runs, and how, is the forward planner's decision
// (../plan/forward_plan.h); the backward's, the backward planner's.
#include <array>
#include <atomic>

#include "../operator/backend_queries.h"
#include "../operator/cuda_archs.h"
#include "../composite/fused.h"
#include "../binding/kernel_table.h"
#include "../operator/output.h"
#include "../operator/validation.h"
#include "backward/backward.h"
#include "device_info.h"
#include "host.h"
#include "kernel_image.h"
#include "entry_points.h"

namespace msda {
namespace {

// Before the first launch on a device: an error naming the architectures
// this build has and the one the device needs when it has no kernel the
// device runs, instead of CUDA's "no kernel image" at the first launch.
void require_kernel_image(int32_t device) {
  static std::array<std::atomic<bool>, 64> checked{};
  const bool cached = device >= 0 && device < static_cast<int>(checked.size());
  if (cached && checked[device].load(std::memory_order_relaxed)) return;
  const cudaError_t err = cuda::kernel_image_status();
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) {
    (void)cudaGetLastError();
    cudaDeviceProp pr{};
    MSDA_CUDA_CHECK(cudaGetDeviceProperties(&pr, device));
    std::string msg = kernel_image_error(cuda_archs(), pr.major, pr.minor,
                                         "cuda:" + std::to_string(device) + " (" + pr.name + ")");
    MSDA_CHECK(false, msg.empty() ? "ms_deform_attn: the CUDA runtime finds no kernel image for "
                                     "this device (" + std::string(cudaGetErrorString(err)) + ")"
                                   : msg);
  }
  MSDA_CUDA_CHECK(err);
  if (cached) checked[device].store(true, std::memory_order_relaxed);
}

// t, or a copy of it whose data is aligned to `align` bytes.
Tensor aligned(Tensor t, int64_t align) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % align == 0 ? t : clone(t);
}

// Locations are read as (x, y) pairs with one vector load: keep them aligned.
Tensor aligned_pairs(Tensor t) { return aligned(t, 2 * dtype_size(dtype_of(t))); }

// The launcher of each backend with a CUDA kernel.
cudaError_t launch(const ForwardParams& p, cudaStream_t stream) {
  switch (p.plan.backend) {
    case ForwardBackend::baseline: return cuda::baseline_forward(p, stream);
    case ForwardBackend::blocked: return cuda::blocked_forward(p, stream);
    case ForwardBackend::persistent: return cuda::persistent_forward(p, stream);
    case ForwardBackend::cluster: return cuda::cluster_forward(p, stream);
    case ForwardBackend::tma: return cuda::tma_forward(p, stream);
    case ForwardBackend::cpu:
    case ForwardBackend::pytorch: break;
  }
  return cudaErrorInvalidValue;
}


// Allocates the output and launches the plan's kernel on the prepared
// inputs; with `ref` set (ms_deform_attn_fused, plan not composite) loc and
// attn hold offsets and logits and ref the float32 reference points.
Tensor launch_forward(Prepared& in, const ForwardPlan& plan, const float* ref = nullptr,
                          int ref_dim = 0) {
  const auto& pb = in.pb;
  const Device dev = in.device;
  auto out = new_output({pb.N, pb.Lq, pb.M * pb.D}, in.value_dtype, dev);
  if (out.numel() == 0) return out;
  in.loc = aligned_pairs(in.loc);
  if (plan.copy_value) in.value = clone(in.value);
  ForwardParams p;
  set_inputs(p, in);
  p.out = out.data_ptr();
  p.ref = ref;
  p.ref_dim = ref_dim;
  p.plan = plan;
  p.vec = plan.vec;
  std::optional<Tensor> workspace;  // optional: an empty stable Tensor costs an allocation
  const cudaStream_t stream = cuda::current_stream(dev.index());
  if (plan.workspace > 0) {
    // Zeroed by a memset on the stream (graph-capturable; compute-sanitizer's
    // initcheck sees it, unlike a fill by a kernel it does not instrument).
    workspace = empty({plan.workspace}, kByte, dev);
    p.workspace = workspace->data_ptr();
    MSDA_CUDA_CHECK(cudaMemsetAsync(p.workspace, 0, plan.workspace, stream));
  }
  MSDA_CUDA_CHECK(launch(p, stream));
  return out;
}

Tensor forward_cuda(const Tensor& value, const Tensor& spatial_shapes,
                        const Tensor& level_start_index, const Tensor& sampling_locations,
                        const Tensor& attention_weights, std::string_view backend,
                        std::optional<bool> /*deterministic: the forward always is*/,
                        const IntListOpt& spatial_shapes_list) {
  Prepared in = prepare_inputs(value, spatial_shapes, level_start_index, sampling_locations,
                               attention_weights, backend, spatial_shapes_list);
  const cuda::DeviceGuard guard(in.device.index());
  require_kernel_image(in.device.index());
  return launch_forward(
      in, plan_forward_for(forward_problem(in.pb, in.value.data_ptr(), /*fused=*/false),
                           in.device, backend));
}

// The fused operator's inputs as the kernels take them: offsets and logits
// (N, Lq, M, L, P) in one dtype (value's or float32), validated as the
// locations and weights would be; reference points as float32.
struct FusedPrepared {
  FusedSizes s;
  Prepared in;
  Tensor ref;
};

FusedPrepared prepare_fused(const FusedSizes& s, const Tensor& value,
                            const Tensor& spatial_shapes, const Tensor& level_start_index,
                            const Tensor& reference_points, const Tensor& sampling_offsets,
                            const Tensor& attention_logits, std::string_view backend = "auto",
                            const IntListOpt& spatial_shapes_list = std::nullopt) {
  const auto vt = dtype_of(value);
  const bool as_is = dtype_of(sampling_offsets) == dtype_of(attention_logits) &&
                     (dtype_of(sampling_offsets) == vt ||
                      dtype_of(sampling_offsets) == kFloat);
  const Tensor off = as_is ? sampling_offsets : to(sampling_offsets, kFloat);
  const Tensor logits =
      reshape(as_is ? attention_logits : to(attention_logits, kFloat), {s.N, s.Lq, s.M, s.L, s.P});
  return {s,
          prepare_inputs(value, spatial_shapes, level_start_index, off, logits, backend,
                         spatial_shapes_list),
          make_contiguous(to(reference_points, kFloat))};
}

// ms_deform_attn_fused on CUDA: the baseline and blocked kernels form the
// locations and the softmax themselves (nothing of size N x Lq x M x L x P
// is made); where the plan says composite (other backends, fp64 values) the
// composite (fused.cpp) serves it.
Tensor fused_forward_cuda(const Tensor& value, const Tensor& spatial_shapes,
                              const Tensor& level_start_index,
                              const Tensor& reference_points,
                              const Tensor& sampling_offsets,
                              const Tensor& attention_logits, std::string_view backend,
                              std::optional<bool> deterministic,
                              const IntListOpt& spatial_shapes_list) {
  const FusedSizes s = check_fused_inputs(value, spatial_shapes, reference_points,
                                          sampling_offsets, attention_logits);
  auto composite = [&] {
    return fused_forward_formed(s, value, spatial_shapes, level_start_index, reference_points,
                                sampling_offsets, attention_logits, backend, deterministic,
                                spatial_shapes_list);
  };
  FusedPrepared f = prepare_fused(s, value, spatial_shapes, level_start_index, reference_points,
                                  sampling_offsets, attention_logits, backend, spatial_shapes_list);
  const cuda::DeviceGuard guard(f.in.device.index());
  const ForwardPlan plan = plan_forward_for(
      forward_problem(f.in.pb, f.in.value.data_ptr(), /*fused=*/true), f.in.device, backend);
  if (plan.composite) return composite();
  require_kernel_image(f.in.device.index());
  return launch_forward(f.in, plan, data_as<float>(f.ref), s.boxes ? 4 : 2);
}

// The backward's parameters for the prepared inputs: grad_output checked
// against them (its contiguous copy kept in `gout`), locations aligned.
BackwardParams backward_params(Prepared& in, const Tensor& grad_output,
                               std::optional<Tensor>& gout) {
  check_grad_output(grad_output, in);
  gout = make_contiguous(grad_output);
  in.loc = aligned_pairs(in.loc);
  BackwardParams p;
  set_inputs(p, in);
  p.grad_out = gout->data_ptr();
  return p;
}

std::tuple<Tensor, Tensor, Tensor> backward_cuda(
    const Tensor& grad_output, const Tensor& value, const Tensor& spatial_shapes,
    const Tensor& level_start_index, const Tensor& sampling_locations,
    const Tensor& attention_weights, bool deterministic) {
  Prepared in = prepare_inputs(value, spatial_shapes, level_start_index, sampling_locations,
                               attention_weights);
  const Device dev = in.device;
  const cuda::DeviceGuard guard(dev.index());
  require_kernel_image(dev.index());
  auto grad_loc = new_output(in.loc.sizes(), in.loc_dtype, dev);
  auto grad_attn = new_output(in.attn.sizes(), in.loc_dtype, dev);
  std::optional<Tensor> gout;
  BackwardParams p = backward_params(in, grad_output, gout);
  p.grad_loc = grad_loc.data_ptr();
  p.grad_attn = grad_attn.data_ptr();
  p.plan = plan_backward_for(backward_problem(in.pb, p.value, p.grad_out, /*fused=*/false), dev,
                             deterministic);
  Tensor grad_value = cuda::run_backward(p, in, cuda::current_stream(dev.index()));
  return {grad_value, to(grad_loc, in.loc_dtype_in), to(grad_attn, in.attn_dtype_in)};
}

// The fused operator's backward on CUDA (without the reference points'
// gradient): its kernels form the locations and the softmax themselves and
// write the offsets' and logits' gradients (in the offsets' dtype from the
// tensor-core dots, else float32, then converted). Where the plan says so
// (fp64 values, rows the FFMA kernel cannot take in one vectorised pass) the
// composite (fused.cpp) serves it.
std::tuple<Tensor, Tensor, Tensor> fused_backward_cuda(
    const Tensor& grad_output, const Tensor& value, const Tensor& spatial_shapes,
    const Tensor& level_start_index, const Tensor& reference_points,
    const Tensor& sampling_offsets, const Tensor& attention_logits, bool deterministic) {
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
  const Device dev = in.device;
  const cuda::DeviceGuard guard(dev.index());
  require_kernel_image(dev.index());
  const auto& pb = in.pb;
  std::optional<Tensor> gout;
  BackwardParams p = backward_params(in, grad_output, gout);
  p.plan = plan_backward_for(backward_problem(pb, p.value, p.grad_out, /*fused=*/true), dev,
                             deterministic);
  if (p.plan.composite) return composite();
  const ScalarType grads = p.plan.dots != DotsKernel::ffma ? in.loc_dtype : kFloat;
  auto grad_off = new_output(in.loc.sizes(), grads, dev);
  auto grad_logits = new_output(in.attn.sizes(), grads, dev);
  p.grad_loc = grad_off.data_ptr();
  p.grad_attn = grad_logits.data_ptr();
  p.ref = data_as<float>(f.ref);
  p.ref_dim = s.boxes ? 4 : 2;
  std::optional<Tensor> row_stats;
  if (p.plan.deterministic()) {
    row_stats = empty({pb.N * pb.Lq * pb.M, 2}, kFloat, dev);
    p.row_stats = data_as<float>(*row_stats);
  }
  Tensor grad_value = cuda::run_backward(p, in, cuda::current_stream(dev.index()));
  return {grad_value, to(grad_off, dtype_of(sampling_offsets)),
          view(to(grad_logits, dtype_of(attention_logits)), sizes_of(attention_logits))};
}

// _column_sum on CUDA: column_sum.cu's two passes (partial sums of row
// chunks, then their totals in chunk order).
Tensor column_sum_cuda(const Tensor& grad) {
  const ColumnSumSizes z = check_column_sum(grad);
  const Tensor g = make_contiguous(grad);
  const Device dev = g.device();
  const ScalarType dt = dtype_of(g);
  Tensor out = empty({z.cols}, dt, dev);
  if (z.cols == 0) return out;
  const cuda::DeviceGuard guard(dev.index());
  require_kernel_image(dev.index());
  cuda::ColumnSumParams p;
  p.dtype = to_dtype(dt);
  p.grad = g.data_ptr();
  p.rows = z.rows;
  p.cols = z.cols;
  const int64_t elem = dtype_size(dt);
  p.vec = cuda::pick_vec(z.cols, elem, static_cast<int>(16 / elem), {p.grad});
  DeviceInfo info;
  MSDA_CUDA_CHECK(cuda::device_info(dev.index(), info));
  p.shape = cuda::column_sum_shape(z.rows, z.cols, p.vec, info.sms);
  const auto acc = dt == kDouble ? kDouble : kFloat;
  Tensor partial = empty({p.shape.chunks, z.cols}, acc, dev);
  p.partial = partial.data_ptr();
  p.out = out.data_ptr();
  MSDA_CUDA_CHECK(cuda::column_sum(p, cuda::current_stream(dev.index())));
  return out;
}

constexpr KernelEntry kKernels[] = {
    MSDA_KERNEL(column_sum_cuda, "CUDA", "_column_sum", &column_sum_cuda),
    MSDA_KERNEL(forward_cuda, "CUDA", "ms_deform_attn", &forward_cuda),
    MSDA_KERNEL(backward_cuda, "CUDA", "_ms_deform_attn_backward", &backward_cuda),
    MSDA_KERNEL(fused_forward_cuda, "CUDA", "ms_deform_attn_fused", &fused_forward_cuda),
    MSDA_KERNEL(fused_backward_cuda, "CUDA", "_ms_deform_attn_fused_backward",
                &fused_backward_cuda),
};

}  // namespace

KernelTable cuda_kernels() { return kKernels; }

}  // namespace msda
