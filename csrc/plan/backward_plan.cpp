// The backward planner (backward_plan.h): every choice of the CUDA backward's
// path and kernels, as a pure function. The thresholds are measured ones;
// docs/backward.md gives the figures.
#include "backward_plan.h"

#include "../binding/check.h"

#include <cstdint>

#include "launch_shapes.h"

namespace msda {
namespace {

using cuda::kLocalCap;
using cuda::kLocalCapSmall;
using cuda::padded_points;

bool half_dtype(DType t) { return t == DType::f16 || t == DType::bf16; }

// Elements a vector access: `want` where it divides D and the pointers read
// that way (grad_output, and value unless only grad_output is) are aligned
// to want elements, else 1 (the kernels are built for these two widths).
int vector_width(const BackwardProblem& p, int want, bool reads_value = true) {
  const int64_t bytes = want * dtype_bytes(p.pb.value_dtype);
  const bool aligned = (!reads_value || p.value_align >= bytes) && p.grad_out_align >= bytes;
  return p.pb.D % want == 0 && aligned ? want : 1;
}

// The sorted path is also the faster one: 16-bit values whose dots and
// grad_value run on tensor cores, with between a third of a sample and D
// samples a value pixel (S / 3 <= Lq L P <= S D: the encoders; the upper
// bound keeps the sorted path's scratch, 32 bytes a sample, within 8x the
// atomic accumulator's 4 D bytes a pixel); and 16-bit values wherever the
// block-local grad_value applies (the decoders, no sort).
bool sorted_preferred(const BackwardProblem& p, const DeviceInfo& d) {
  const Problem& pb = p.pb;
  const int64_t samples = pb.Lq * pb.L * pb.P;
  const bool dense = half_dtype(pb.value_dtype) && mma_dots_ok(p) && 3 * samples >= pb.S &&
                     samples <= pb.S * pb.D;
  return dense || (half_dtype(pb.value_dtype) && local_grad_value_ok(p, d));
}

bool wants_reproducible(const BackwardProblem& p, const DeviceInfo& d, const BackwardWishes& w) {
  switch (w.request) {
    case GradValueRequest::atomic: return w.deterministic;
    case GradValueRequest::sorted:
    case GradValueRequest::local: return true;
    default: return w.deterministic || sorted_preferred(p, d);
  }
}

// The tensor-core dots kernel's form for p.
DotsKernel mma_form(const BackwardProblem& p, const DeviceInfo& d) {
  const Problem& pb = p.pb;
  const int LPp = pb.L * padded_points(pb.P);
  const bool rows_idle = 32 % LPp != 0;  // whole rows leave lanes of a warp idle
  if (p.fused) return rows_idle ? DotsKernel::mma_rows : DotsKernel::mma;
  // The flat slot sequence, its slots indexed in 32 bits, and only with
  // enough tasks a resident warp: faster on the encoders, slower on a
  // decoder's few tasks.
  const int64_t slots = pb.N * pb.Lq * pb.M * LPp;
  const int64_t resident_warps = int64_t(d.sms) * cuda::kDotsBlocksPerSm * cuda::kWarps;
  const bool flat = rows_idle && slots + 32 <= int64_t(INT32_MAX) &&
                    (slots + 31) / 32 >= cuda::kFlatTasksPerWarp * resident_warps;
  return flat ? DotsKernel::mma_flat : DotsKernel::mma;
}

}  // namespace

GradValueRequest parse_grad_value_request(const std::string& name) {
  if (name.empty() || name == "auto") return GradValueRequest::automatic;
  if (name == "atomic") return GradValueRequest::atomic;
  if (name == "sorted") return GradValueRequest::sorted;
  if (name == "local") return GradValueRequest::local;
  MSDA_CHECK(false, "ms_deform_attn: unknown grad_value path '", name,
              "'; expected 'auto', 'atomic', 'sorted' or 'local'");
}

bool mma_dots_ok(const BackwardProblem& p) {
  const Problem& pb = p.pb;
  return pb.D % 32 == 0 && pb.L * padded_points(pb.P) <= 32 &&
         pb.N * pb.S * pb.M <= int64_t(UINT32_MAX) && pb.N * pb.Lq * pb.M < int64_t(INT32_MAX) &&
         p.value_align >= 16 && p.grad_out_align >= 16;
}

bool local_grad_value_ok(const BackwardProblem& p, const DeviceInfo& d) {
  const Problem& pb = p.pb;
  const int64_t elem = dtype_bytes(pb.value_dtype);
  const int64_t smem = pb.Lq * pb.P <= kLocalCapSmall ? cuda::kLocalSmemSmall : cuda::kLocalSmem;
  const bool fits = d.smem_optin >= smem;
  return fits && pb.value_dtype != DType::f64 && pb.L >= 1 && pb.Lq * pb.P <= kLocalCap &&
         pb.N * pb.M * pb.S < (int64_t(1) << 31) && pb.S < (int64_t(1) << 30) &&
         sample_count(pb) < (int64_t(1) << 31) && pb.M * pb.D * elem <= int64_t(UINT32_MAX) &&
         pb.D % (16 / elem) == 0 && p.grad_out_align >= 16;
}

bool local_stage_ok(const BackwardProblem& p, const DeviceInfo& d) {
  const Problem& pb = p.pb;
  const int64_t bytes = cuda::local_stage_bytes(pb.Lq, pb.P, pb.D, dtype_bytes(pb.value_dtype));
  return pb.Lq * pb.P <= kLocalCapSmall && bytes <= cuda::kLocalStageMax &&
         cuda::kLocalSmemSmall + bytes <= d.smem_optin;
}

BackwardPlan plan_backward(const BackwardProblem& p, const DeviceInfo& d, const BackwardWishes& w) {
  const Problem& pb = p.pb;
  BackwardPlan plan;
  const bool f64 = pb.value_dtype == DType::f64;
  // The fused kernels need float accumulation and at least one row.
  if (p.fused && (f64 || pb.N * pb.Lq * pb.M == 0)) {
    plan.composite = true;
    return plan;
  }
  const bool reproducible = wants_reproducible(p, d, w);
  if (reproducible) {
    plan.grad_value = w.request != GradValueRequest::sorted && local_grad_value_ok(p, d)
                          ? GradValuePath::local
                          : GradValuePath::sorted;
    plan.stage = plan.grad_value == GradValuePath::local && w.stage && local_stage_ok(p, d);
    plan.self_records = plan.stage && !p.fused && w.self_records;
  }
  // Vectors of 16 bytes of the accumulator (4 fp32 / 2 fp64 channels) with
  // atomics, so that a group's vector atomic covers a 128-byte line; 32
  // bytes without, which halves the work every lane repeats.
  const int want = (f64 ? 2 : 4) * (reproducible ? 2 : 1);
  plan.vec = vector_width(p, want);
  const bool mma = reproducible && half_dtype(pb.value_dtype) && mma_dots_ok(p);
  plan.dots = mma ? mma_form(p, d) : DotsKernel::ffma;
  // The fused FFMA kernel takes a whole row in one channel pass, vectorised.
  if (p.fused && !mma && (plan.vec != want || pb.D > int64_t(32) * want)) {
    plan = BackwardPlan{};
    plan.composite = true;
    return plan;
  }
  if (plan.grad_value == GradValuePath::sorted) {
    // 16 bytes of the value dtype a lane (32 of the accumulator measured
    // slower); it reads grad_output and writes a fresh grad_value.
    const int elems = static_cast<int>(16 / dtype_bytes(pb.value_dtype));
    plan.gather_vec = vector_width(p, elems, /*reads_value=*/false);
    const bool tiles = half_dtype(pb.value_dtype) && plan.gather_vec == elems && pb.D % 32 == 0 &&
                       pb.N * pb.M * pb.S < (int64_t(1) << 31);
    plan.gather = tiles ? GatherKernel::tiles : GatherKernel::pixels;
  }
  return plan;
}

const char* grad_value_name(GradValuePath path) {
  static const char* names[] = {"atomic", "sorted", "local"};
  return names[int(path)];
}

const char* dots_name(DotsKernel dots) {
  static const char* names[] = {"ffma", "mma", "mma_flat", "mma_rows"};
  return names[int(dots)];
}

const char* gather_name(GatherKernel gather) {
  static const char* names[] = {"none", "pixels", "tiles"};
  return names[int(gather)];
}

}  // namespace msda
