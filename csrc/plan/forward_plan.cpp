// The forward planner (forward_plan.h): the backend table, each backend's
// can-run checks, auto's order and every launch choice of the CUDA forward,
// as pure functions of the problem, the device and the caller's wishes.
#include "forward_plan.h"

#include "../binding/check.h"

#include <algorithm>
#include <sstream>

#include "launch_shapes.h"

namespace msda {
namespace {

using cuda::kThreads;

std::string needs_sm90(const DeviceInfo& d, const char* what) {
  if (d.major >= 9) return "";
  std::ostringstream os;
  os << "needs " << what << " (compute capability 9.0 or later), device has " << d.major << "."
     << d.minor;
  return os.str();
}

std::string runs_anywhere(const DeviceInfo&) { return ""; }
std::string needs_clusters(const DeviceInfo& d) { return needs_sm90(d, "thread block clusters"); }
std::string needs_tma(const DeviceInfo& d) {
  return needs_sm90(d, "the Tensor Memory Accelerator");
}

std::string runs_any_problem(const ForwardProblem&) { return ""; }

std::string tma_problem(const ForwardProblem& p) {
  const Problem& pb = p.pb;
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

std::string blocked_problem(const ForwardProblem& p) {
  const Problem& pb = p.pb;
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

bool never(const ForwardProblem&) { return false; }
bool always(const ForwardProblem&) { return true; }
// `blocked` over `baseline`: the benchmark's verdict (BENCHMARKS.md,
// docs/performance.md). Its gain is the L1 reuse of one head's corner rows
// and a cheaper block prologue; with one head (seed) the prologue alone
// still puts it ahead. fp64 is not measured.
bool blocked_auto(const ForwardProblem& p) { return p.pb.value_dtype != DType::f64; }

// A forward backend: where it runs (CPU tensors, CUDA tensors, or from
// Python only: `pytorch`, which the C++ operator refuses), its checks on a
// CUDA device (device_reason: the device alone, what available_backends
// lists; problem_reason: the inputs too; "" when it can), whether "auto"
// may pick it (auto_ok: the benchmark's verdict), the byte alignment it
// needs of value's data (a misaligned value is copied), and whether its
// kernel forms ms_deform_attn_fused's locations and softmax itself (the
// fused operator takes its composite on the others).
struct Backend {
  const char* name;
  ForwardBackend id;
  Runs runs;
  std::string (*device_reason)(const DeviceInfo&);
  std::string (*problem_reason)(const ForwardProblem&);
  bool (*auto_ok)(const ForwardProblem&);
  int value_align;
  bool fused_points;
};

// In the order "auto" prefers them: the first whose checks pass and whose
// auto_ok holds is chosen. benchmarks/ measures every backend on the
// canonical workloads (its `auto:` lines check this choice).
const Backend kBackends[] = {
    // The CPU kernel (cpu/), every CPU problem.
    {"cpu", ForwardBackend::cpu, Runs::cpu, runs_anywhere, runs_any_problem, always, 1, false},
    // Slower than baseline on every canonical workload (more instructions a
    // sample than the loads it saves): explicit requests only. 16-byte
    // aligned value: the copy engine's global address alignment.
    {"tma", ForwardBackend::tma, Runs::cuda, needs_tma, tma_problem, never, 16, false},
    // Bound by distributed shared memory's bandwidth, which serves most of
    // every sample's corner reads; slower than baseline: explicit requests only.
    {"cluster", ForwardBackend::cluster, Runs::cuda, needs_clusters, runs_any_problem, never, 1, false},
    // L1/TEX-bound either way, and its shared-memory cache reads conflict;
    // slower than baseline: explicit requests only.
    {"persistent", ForwardBackend::persistent, Runs::cuda, runs_anywhere, runs_any_problem, never, 1, false},
    // Blocks of consecutive queries of one (batch, head); faster than
    // baseline in fp32, bf16 and fp16.
    {"blocked", ForwardBackend::blocked, Runs::cuda, runs_anywhere, blocked_problem, blocked_auto, 1, true},
    {"baseline", ForwardBackend::baseline, Runs::cuda, runs_anywhere, runs_any_problem, always, 1, true},
    // The operator in plain PyTorch ops (reference.ms_deform_attn_plain),
    // which the Python entry points run; never picked by "auto".
    {"pytorch", ForwardBackend::pytorch, Runs::python, runs_anywhere, runs_any_problem, never, 1, false},
};

const char* runs_on(Runs r) { return r == Runs::cpu ? "CPU" : r == Runs::cuda ? "CUDA" : "Python"; }

const Backend* find(const std::string& name) {
  for (const auto& b : kBackends) {
    if (name == b.name) return &b;
  }
  return nullptr;
}

std::string quoted(const std::vector<std::string>& names) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < names.size(); ++i) os << (i ? ", '" : "'") << names[i] << "'";
  os << "]";
  return os.str();
}

std::string why_not(const Backend& b, const ForwardProblem& p, const DeviceInfo& d) {
  std::string why = b.device_reason(d);
  return why.empty() ? b.problem_reason(p) : why;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Cache bytes of a caching backend whose block of `threads` threads holds
// its CornerSlots (and `slack` bytes more) besides: the caller's request, or
// the backend's default, within what a block may opt in to, in 16-byte units.
int64_t smem_budget(const ForwardProblem& p, const DeviceInfo& d, const ForwardWishes& w,
                    int threads, int64_t slack, int64_t fallback) {
  const int acc_bytes = p.pb.value_dtype == DType::f64 ? 8 : 4;
  const int64_t fixed = slack + cuda::corner_slot_bytes_per_thread(acc_bytes) * threads;
  const int64_t cap = d.smem_optin - cuda::kCachingStaticSmem - fixed;
  const int64_t want = w.smem_budget >= 0 ? w.smem_budget : fallback;
  return std::max<int64_t>(0, std::min(want, cap)) / 16 * 16;
}

// `blocked`'s launch: blocks of kThreads, halved while they would leave SMs
// with fewer than kBlockedMinBlocksPerSm blocks; rows with per-lane set-up
// where warps are few (lane_row_split); the slots without the level table
// for one level. Both kernels are instantiated for 16-byte vectors of fp32,
// bf16 or fp16 only, and neither is the fused operator's.
void plan_blocked(const ForwardProblem& p, const DeviceInfo& d, const ForwardWishes& w,
                  ForwardPlan& plan) {
  const Problem& pb = p.pb;
  const int lanes = plan.lanes;
  auto per_head = [&](int threads) { return ceil_div(pb.Lq, threads / lanes); };
  int threads = kThreads;
  while (threads > cuda::kBlockedMinThreads && threads / 2 >= lanes &&
         per_head(threads) * pb.N * pb.M < int64_t(cuda::kBlockedMinBlocksPerSm) * d.sms) {
    threads /= 2;
  }
  const bool vec16_kernels = !p.fused && pb.value_dtype != DType::f64 &&
                             plan.vec * dtype_bytes(pb.value_dtype) == 16;
  const bool lane_rows = vec16_kernels && w.blocked_rows != BlockedRows::shared;
  plan.threads = threads;
  plan.split = lane_rows ? cuda::lane_row_split(pb.N * pb.M * pb.Lq, lanes, pb.L * pb.P, d.sms,
                                                w.blocked_rows == BlockedRows::lane)
                         : 0;
  if (plan.split > 0) {
    plan.blocks_per_head = ceil_div(pb.Lq, threads / (lanes * plan.split));
    plan.resident = cuda::kLaneRowBlocksPerSm * kThreads / threads;
  } else {
    plan.blocks_per_head = per_head(threads);
    plan.resident = cuda::kForwardBlocksPerSm * kThreads / threads;
    // One level needs no table in shared memory, nor the barrier before
    // the rows that waits on its load.
    plan.one_level = vec16_kernels && pb.L == 1;
  }
  plan.blocks = plan.blocks_per_head * pb.N * pb.M;
}

}  // namespace

const std::vector<std::string>& backend_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const auto& b : kBackends) n.emplace_back(b.name);
    return n;
  }();
  return names;
}

void check_backend_name(std::string_view backend) {
  if (backend == "auto") return;
  for (const auto& n : backend_names()) {
    if (backend == n) return;
  }
  MSDA_CHECK(false, "ms_deform_attn: unknown backend '", backend,
              "'; expected 'auto' or one of ", quoted(backend_names()));
}

const char* backend_name(ForwardBackend b) {
  for (const auto& e : kBackends) {
    if (e.id == b) return e.name;
  }
  return "?";
}

std::vector<std::string> backends_on(Runs where, const DeviceInfo* d) {
  std::vector<std::string> names;
  for (const auto& b : kBackends) {
    if (b.runs == where && (where != Runs::cuda || b.device_reason(*d).empty())) {
      names.emplace_back(b.name);
    }
  }
  return names;
}

std::string reference_backend_reason() {
  return "is the operator in plain PyTorch ops, which the Python entry points run "
         "(ms_deform_attn.ms_deform_attn(..., backend='pytorch')); the C++ operator has no "
         "kernel of that name";
}

std::string backend_reason_on(const std::string& name, const ForwardProblem& p, Runs on,
                              const DeviceInfo* d) {
  if (name == "auto") return "";
  const Backend* b = find(name);
  if (b == nullptr) {
    return "unknown backend '" + name + "'; expected 'auto' or one of " + quoted(backend_names());
  }
  if (b->runs == Runs::python) return reference_backend_reason();
  if (b->runs != on) {
    std::ostringstream os;
    os << "cannot run on " << runs_on(on) << " tensors (only on " << runs_on(b->runs)
       << " tensors); backends for " << runs_on(on) << ": " << quoted(backends_on(on, d))
       << " (or 'auto')";
    return os.str();
  }
  return on == Runs::cuda ? why_not(*b, p, *d) : "";
}

std::string auto_backend(const ForwardProblem& p, const DeviceInfo& d) {
  for (const auto& b : kBackends) {
    if (b.runs == Runs::cuda && why_not(b, p, d).empty() && b.auto_ok(p)) return b.name;
  }
  MSDA_CHECK(false, "ms_deform_attn: no CUDA backend can run these inputs");
}

ForwardPlan plan_forward(const ForwardProblem& p, const DeviceInfo& d, const ForwardWishes& w) {
  const std::string name = w.backend == "auto" ? auto_backend(p, d) : w.backend;
  const std::string why = backend_reason_on(name, p, Runs::cuda, &d);
  MSDA_CHECK(why.empty(), "ms_deform_attn: backend '", name, "' cannot run these inputs: ", why);
  const Backend& b = *find(name);
  const Problem& pb = p.pb;
  ForwardPlan plan;
  plan.backend = b.id;
  // The fused kernels need float accumulation and points formed inside.
  if (p.fused && (pb.value_dtype == DType::f64 || !b.fused_points)) {
    plan.composite = true;
    return plan;
  }
  plan.copy_value = p.value_align < b.value_align;
  const int align = plan.copy_value ? 32 : p.value_align;  // a copy is freshly allocated
  const int elem = static_cast<int>(dtype_bytes(pb.value_dtype));
  plan.vec = pb.D % (16 / elem) == 0 && align >= 16 ? 16 / elem : 1;
  plan.lanes = cuda::lanes_for(pb.D, plan.vec);
  switch (b.id) {
    case ForwardBackend::baseline:
      plan.threads = kThreads;
      plan.blocks = ceil_div(pb.N * pb.Lq * pb.M * plan.lanes, kThreads);
      plan.resident = cuda::kForwardBlocksPerSm;
      break;
    case ForwardBackend::blocked:
      plan_blocked(p, d, w, plan);
      break;
    case ForwardBackend::persistent:
      plan.smem_budget = smem_budget(p, d, w, cuda::kPersistentThreads, 0, cuda::kPersistentCache);
      plan.workspace = pb.N * pb.M * int64_t(sizeof(int));  // its tile counters
      break;
    case ForwardBackend::cluster:
      plan.smem_budget = smem_budget(p, d, w, cuda::kClusterThreads, 0, INT64_MAX);
      break;
    case ForwardBackend::tma:
      plan.smem_budget =
          smem_budget(p, d, w, cuda::kTmaThreads, cuda::kTmaAlignSlack, cuda::kTmaStages);
      break;
    case ForwardBackend::cpu:
    case ForwardBackend::pytorch:
      break;
  }
  return plan;
}

}  // namespace msda
