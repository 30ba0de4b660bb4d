// CUDA registration of the operator: the backend table (predicates and the
// order "auto" prefers), validation, allocation and launch on the current
// stream of the value's device. Never synchronises with the host.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdlib>
#include <sstream>

#include "../prepare.h"
#include "launch.h"

namespace msda {
namespace {

// ---- backends ----------------------------------------------------------------
// A predicate returns "" when the backend can run, otherwise the reason it
// cannot. device_reason looks at the device only (what available_backends
// lists); problem_reason at the inputs too. auto_ok says whether "auto" may
// pick it for these inputs (the benchmark's verdict); workspace is the zeroed
// scratch it needs; value_align the byte alignment it needs of value's data
// (a misaligned value is copied).
struct CudaBackend {
  const char* name;
  std::string (*device_reason)(const cudaDeviceProp&);
  std::string (*problem_reason)(const Problem&, const cudaDeviceProp&);
  bool (*auto_ok)(const Problem&, const cudaDeviceProp&);
  int64_t (*workspace)(const Problem&);
  cudaError_t (*forward)(const ForwardParams&, cudaStream_t);
  int64_t value_align;
};

std::string runs_anywhere(const cudaDeviceProp&) { return ""; }
std::string runs_any_problem(const Problem&, const cudaDeviceProp&) { return ""; }
bool always(const Problem&, const cudaDeviceProp&) { return true; }
int64_t no_workspace(const Problem&) { return 0; }

bool never(const Problem&, const cudaDeviceProp&) { return false; }

std::string needs_clusters(const cudaDeviceProp& pr) {
  if (pr.major >= 9) return "";
  std::ostringstream os;
  os << "needs thread block clusters (compute capability 9.0 or later), device has " << pr.major
     << "." << pr.minor;
  return os.str();
}

std::string needs_tma(const cudaDeviceProp& pr) {
  if (pr.major >= 9) return "";
  std::ostringstream os;
  os << "needs the Tensor Memory Accelerator (compute capability 9.0 or later), device has "
     << pr.major << "." << pr.minor;
  return os.str();
}

std::string tma_problem(const Problem& pb, const cudaDeviceProp&) {
  std::ostringstream os;
  const int64_t row = pb.D * dtype_bytes(pb.value_dtype);
  if (!pb.host_shapes) {
    os << "needs the level shapes on the host to build its copy descriptors without a device "
          "sync: pass spatial_shapes_list=[(H, W), ...] (transformers' value_spatial_shapes_list)";
  } else if (pb.value_dtype == DType::f64) {
    os << "supports float32, float16 and bfloat16 values, got float64";
  } else if (row % 16 != 0 || row > 512) {
    os << "needs D * element size to be a multiple of 16 bytes and at most 512, got D = " << pb.D
       << " (" << row << " bytes)";
  }
  return os.str();
}

// The auto-selection table: in preference order, the first backend whose
// predicates pass and whose auto_ok holds is chosen. benchmarks/ measures every
// backend on the canonical workloads (`auto:` lines check this choice).
const CudaBackend kBackends[] = {
    // Needs host-side level shapes (spatial_shapes_list). Measured slower than
    // baseline on every canonical workload (ddetr_enc bf16 252 against 150 us:
    // more instructions a sample than the loads it saves, benchmarks/NOTES.md):
    // explicit requests only.
    // 16-byte aligned value: the copy engine's global address alignment.
    {"tma", needs_tma, tma_problem, never, no_workspace, &cuda::tma_forward, 16},
    // Correct, but bound by distributed shared memory: 2.0 TB/s over the
    // chip (benchmarks/dsmem.py, H200) for ~7/8 of every sample's corner
    // reads; 4.5x slower than baseline on ddetr_enc bf16 (benchmarks/NOTES.md).
    {"cluster", needs_clusters, runs_any_problem, never, no_workspace, &cuda::cluster_forward, 1},
    // Measured slower than baseline on every canonical workload so far
    // (BENCHMARKS.md, benchmarks/NOTES.md: L1/TEX-bound either way, and its
    // shared-memory cache reads conflict): explicit requests only.
    {"persistent", runs_anywhere, runs_any_problem, never, &cuda::persistent_workspace_bytes,
     &cuda::persistent_forward, 1},
    {"baseline", runs_anywhere, runs_any_problem, always, no_workspace, &cuda::baseline_forward, 1},
};

const cudaDeviceProp& props(int device) { return *at::cuda::getDeviceProperties(device); }

int resolve_device(int device) { return device < 0 ? at::cuda::current_device() : device; }

std::string known_names() {
  std::ostringstream os;
  os << "[";
  for (const auto& b : kBackends) os << (&b == kBackends ? "'" : ", '") << b.name << "'";
  os << "]";
  return os.str();
}

std::vector<std::string> available(int device) {
  if (!at::cuda::is_available()) return {};
  const auto& pr = props(resolve_device(device));
  std::vector<std::string> names;
  for (const auto& b : kBackends) {
    if (b.device_reason(pr).empty()) names.emplace_back(b.name);
  }
  return names;
}

std::string select(const Problem& pb, int device) {
  if (const char* env = std::getenv("MS_DEFORM_ATTN_BACKEND")) {
    if (*env && std::string(env) != "auto") return env;
  }
  const auto& pr = props(resolve_device(device));
  for (const auto& b : kBackends) {
    if (b.device_reason(pr).empty() && b.problem_reason(pb, pr).empty() && b.auto_ok(pb, pr)) {
      return b.name;
    }
  }
  TORCH_CHECK(false, "ms_deform_attn: no CUDA backend can run these inputs");
}

const CudaBackend* find(const std::string& name) {
  for (const auto& b : kBackends) {
    if (name == b.name) return &b;
  }
  return nullptr;
}

std::string unknown(const std::string& name) {
  return "unknown backend '" + name + "'; expected 'auto' or one of " + known_names();
}

// Why backend b cannot run pb on `device` ("" when it can).
std::string why_not(const CudaBackend& b, const Problem& pb, int device) {
  const auto& pr = props(resolve_device(device));
  std::string why = b.device_reason(pr);
  return why.empty() ? b.problem_reason(pb, pr) : why;
}

std::string reason(const std::string& name, const Problem& pb, int device) {
  const CudaBackend* b = find(name);
  return b == nullptr ? unknown(name) : why_not(*b, pb, device);
}

const CudaBackend& find_runnable(const std::string& name, const Problem& pb, int device) {
  const CudaBackend* b = find(name);
  TORCH_CHECK(b != nullptr, "ms_deform_attn: ", unknown(name));
  const std::string why = why_not(*b, pb, device);
  TORCH_CHECK(why.empty(), "ms_deform_attn: backend '", name, "' cannot run these inputs: ", why);
  return *b;
}

// ---- operator ------------------------------------------------------------------
// t, or a copy of it whose data is aligned to `align` bytes.
at::Tensor aligned(at::Tensor t, int64_t align) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % align == 0 ? t : t.clone();
}

// Locations are read as (x, y) pairs with one vector load: keep them aligned.
at::Tensor aligned_pairs(at::Tensor t) { return aligned(t, 2 * t.element_size()); }

at::Tensor forward_cuda(const at::Tensor& value, const at::Tensor& spatial_shapes,
                        const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                        const at::Tensor& attention_weights, c10::string_view backend,
                        std::optional<bool> /*deterministic: the forward always is*/,
                        at::OptionalIntArrayRef spatial_shapes_list) {
  Prepared in = prepare_inputs(value, spatial_shapes, level_start_index, sampling_locations,
                               attention_weights, spatial_shapes_list);
  const c10::cuda::CUDAGuard guard(value.device());
  const int device = value.device().index();
  const auto& pb = in.pb;
  const std::string name = backend == "auto" ? select(pb, device) : std::string(backend);
  const CudaBackend& impl = find_runnable(name, pb, device);

  auto out = new_output({pb.N, pb.Lq, pb.M * pb.D}, in.value.options());
  if (out.numel() == 0) return out;
  in.loc = aligned_pairs(in.loc);
  in.value = aligned(in.value, impl.value_align);
  ForwardParams p;
  set_inputs(p, in);
  p.out = out.data_ptr();
  const int64_t elem = in.value.element_size();
  p.vec = pick_vec(pb.D, elem, static_cast<int>(16 / elem), {p.value, p.out});
  at::Tensor workspace;
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (const int64_t bytes = impl.workspace(pb); bytes > 0) {
    // Zeroed by a memset on the stream (graph-capturable; compute-sanitizer's
    // initcheck sees it, unlike a fill by a kernel it does not instrument).
    workspace = at::empty({bytes}, in.value.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
    C10_CUDA_CHECK(cudaMemsetAsync(p.workspace, 0, bytes, stream));
  }
  // Test hook: shrink the shared-memory budget of the caching backends.
  if (const char* env = std::getenv("MS_DEFORM_ATTN_SMEM_BUDGET")) p.smem_budget = std::atoll(env);
  C10_CUDA_CHECK(impl.forward(p, stream));
  return out;
}

// Bits needed to write every value in [0, x].
int bits_for(int64_t x) {
  int bits = 0;
  while (bits < 63 && (int64_t(1) << bits) <= x) ++bits;
  return bits;
}

// grad_value by sort and gather (backward_deterministic.cu): bitwise the same
// on every run. Scratch: per sample 4 keys / ids (4 bytes each, 8 when wide),
// 4 weights (16 bytes; 32 for fp64) and the sort's temp; 8 bytes per cell.
at::Tensor deterministic_grad_value(BackwardParams p, const Prepared& in, cudaStream_t stream) {
  const auto& pb = in.pb;
  p.cell_stride = 2 * pb.S + 2 * pb.L;
  cuda::DeterministicBuffers b;
  b.items = pb.N * pb.Lq * pb.M * pb.L * pb.P;
  b.cells = pb.N * pb.M * p.cell_stride;
  b.end_bit = bits_for(b.cells);
  b.wide = b.cells >= int64_t(UINT32_MAX) || b.items >= int64_t(UINT32_MAX);
  if (b.items == 0) return at::zeros(in.value.sizes(), in.value.options());
  const auto idx = in.value.options().dtype(b.wide ? at::kLong : at::kInt);
  at::Tensor keys = at::empty({b.items}, idx), ids = at::empty({b.items}, idx);
  at::Tensor sorted_keys = at::empty({b.items}, idx), sorted_ids = at::empty({b.items}, idx);
  p.grad_value_acc = nullptr;
  p.cell_keys = keys.data_ptr();
  p.sample_ids = ids.data_ptr();
  p.wide_keys = b.wide;
  C10_CUDA_CHECK(cuda::backward(p, stream));

  b.keys = keys.data_ptr();
  b.ids = ids.data_ptr();
  b.sorted_keys = sorted_keys.data_ptr();
  b.sorted_ids = sorted_ids.data_ptr();
  C10_CUDA_CHECK(cuda::deterministic_temp_bytes(b, b.temp_bytes));
  at::Tensor temp = at::empty({int64_t(std::max<size_t>(b.temp_bytes, 1))},
                              in.value.options().dtype(at::kByte));
  b.temp = temp.data_ptr();
  at::Tensor starts = at::empty({b.cells + 1}, in.value.options().dtype(at::kLong));
  b.cell_starts = starts.data_ptr();
  b.rows = keys.data_ptr();  // the unsorted keys are dead once sorted
  const auto acc_type = in.value.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor weights = at::empty({4 * b.items}, in.value.options().dtype(acc_type));
  b.weights = weights.data_ptr();
  at::Tensor grad_value = new_output(in.value.sizes(), in.value.options());
  b.grad_value = grad_value.data_ptr();
  // 16 bytes of the value dtype per lane (tried: 32 bytes of the fp32
  // accumulator made the fp32 gather 1.4x slower, benchmarks/NOTES.md).
  const int64_t elem = in.value.element_size();
  b.vec = pick_vec(pb.D, elem, static_cast<int>(16 / elem), {p.grad_out, b.grad_value});
  C10_CUDA_CHECK(cuda::deterministic_value_grad(p, b, stream));
  return grad_value;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
    const at::Tensor& attention_weights, bool deterministic) {
  Prepared in = prepare_inputs(value, spatial_shapes, level_start_index, sampling_locations,
                               attention_weights);
  const c10::cuda::CUDAGuard guard(value.device());
  const auto& pb = in.pb;
  const at::Tensor gout = prepare_grad_output(grad_output, in);
  const auto vt = in.value.scalar_type();
  const auto acc_type = vt == at::kDouble ? at::kDouble : at::kFloat;
  auto grad_loc = new_output(in.loc.sizes(), in.loc.options());
  auto grad_attn = new_output(in.attn.sizes(), in.attn.options());
  const auto stream = at::cuda::getCurrentCUDAStream();
  in.loc = aligned_pairs(in.loc);
  BackwardParams p;
  set_inputs(p, in);
  p.grad_out = gout.data_ptr();
  p.grad_loc = grad_loc.data_ptr();
  p.grad_attn = grad_attn.data_ptr();
  // Vectors of 16 bytes of the accumulator (4 fp32 / 2 fp64 channels) with
  // atomics, 32 bytes without (see backward.cu).
  const int want = (vt == at::kDouble ? 2 : 4) * (deterministic ? 2 : 1);
  p.vec = pick_vec(pb.D, in.value.element_size(), want, {p.value, p.grad_out});
  at::Tensor grad_value;
  if (deterministic) {
    grad_value = deterministic_grad_value(p, in, stream);
  } else {
    auto grad_value_acc = at::zeros(in.value.sizes(), in.value.options().dtype(acc_type));
    if (pb.N * pb.Lq * pb.M > 0) {
      p.grad_value_acc = grad_value_acc.data_ptr();
      C10_CUDA_CHECK(cuda::backward(p, stream));
    }
    grad_value = grad_value_acc.to(vt);
  }
  return {grad_value, grad_loc.to(in.loc_dtype_in), grad_attn.to(in.attn_dtype_in)};
}

// Installs the CUDA hooks when the library loads.
const bool kHooksInstalled = [] {
  cuda_hooks().available = &available;
  cuda_hooks().select = &select;
  cuda_hooks().reason = &reason;
  return true;
}();

}  // namespace
}  // namespace msda

TORCH_LIBRARY_IMPL(ms_deform_attn, CUDA, m) {
  m.impl("ms_deform_attn", &msda::forward_cuda);
  m.impl("_ms_deform_attn_backward", &msda::backward_cuda);
}
