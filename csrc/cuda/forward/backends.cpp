// The CUDA forward backend table (see backends.h) and the auto policy, and
// the hooks through which ../../backends.cpp asks it.
#include "backends.h"

#include <ATen/cuda/CUDAContext.h>

#include <sstream>

#include "../../backends.h"
#include "../../overrides.h"
#include "../launch.h"

namespace msda::cuda {
namespace {

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

std::string blocked_problem(const Problem& pb, const cudaDeviceProp&) {
  std::ostringstream os;
  const int64_t rows = pb.N * pb.M * pb.Lq;
  if (pb.S > INT32_MAX) {
    os << "needs S (the pixels of all levels) below 2^31, got " << pb.S;
  } else if (rows > INT32_MAX) {
    os << "needs N * M * Lq below 2^31 (one block per (batch, head) and run of queries), got "
       << rows;
  }
  return os.str();
}

// Where "auto" takes `blocked` over `baseline`: the benchmark's verdict
// (BENCHMARKS.md, docs/performance.md). Its gain is the L1 reuse of one
// head's corner rows and a cheaper block prologue; with one head (seed) the
// prologue alone still puts it ahead. fp64 is not measured.
bool blocked_auto(const Problem& pb, const cudaDeviceProp&) {
  return pb.value_dtype != DType::f64;
}

// The auto-selection table: in preference order, the first backend whose
// predicates pass and whose auto_ok holds is chosen. benchmarks/ measures every
// backend on the canonical workloads (`auto:` lines check this choice).
const CudaBackend kBackends[] = {
    // Needs host-side level shapes (spatial_shapes_list). Measured slower than
    // baseline on every canonical workload (more instructions a sample than
    // the loads it saves; BENCHMARKS.md, docs/performance.md): explicit
    // requests only.
    // 16-byte aligned value: the copy engine's global address alignment.
    {"tma", needs_tma, tma_problem, never, no_workspace, &cuda::tma_forward, 16},
    // Correct, but bound by the bandwidth of distributed shared memory
    // (benchmarks/dsmem.py measures it), which serves most of every sample's
    // corner reads; slower than baseline (BENCHMARKS.md, docs/performance.md).
    {"cluster", needs_clusters, runs_any_problem, never, no_workspace, &cuda::cluster_forward, 1},
    // Measured slower than baseline on every canonical workload so far
    // (BENCHMARKS.md, docs/performance.md: L1/TEX-bound either way, and its
    // shared-memory cache reads conflict): explicit requests only.
    {"persistent", runs_anywhere, runs_any_problem, never, &cuda::persistent_workspace_bytes,
     &cuda::persistent_forward, 1},
    // Blocks of consecutive queries of one (batch, head); faster than
    // baseline in fp32, bf16 and fp16.
    {"blocked", runs_anywhere, blocked_problem, blocked_auto, no_workspace, &cuda::blocked_forward, 1, true},
    {"baseline", runs_anywhere, runs_any_problem, always, no_workspace, &cuda::baseline_forward, 1, true},
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
  if (std::string name = backend_override(); !name.empty()) return name;
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


// Installs the hooks when the library loads; every table name must be one
// the library declares (../backends.cpp).
const bool kHooksInstalled = [] {
  for (const auto& b : kBackends) {
    bool known = false;
    for (const auto& n : backend_names()) known = known || n == b.name;
    TORCH_INTERNAL_ASSERT(known, "backend '", b.name, "' missing from backend_names()");
  }
  cuda_hooks().available = &available;
  cuda_hooks().select = &select;
  cuda_hooks().reason = &reason;
  return true;
}();

}  // namespace

const CudaBackend& backend_for(c10::string_view backend, const Problem& pb, int device) {
  const std::string name = backend == "auto" ? select(pb, device) : std::string(backend);
  // The device-agnostic answer first: "cpu" is a backend, not of this table.
  const std::string why =
      msda::backend_reason(name, pb, c10::Device(c10::DeviceType::CUDA, resolve_device(device)));
  TORCH_CHECK(why.empty(), "ms_deform_attn: backend '", name, "' cannot run these inputs: ", why);
  const CudaBackend* b = find(name);
  TORCH_CHECK(b != nullptr, "ms_deform_attn: ", unknown(name));
  return *b;
}

}  // namespace msda::cuda
