// The backward's policy, in one place (the plan's fields: params.h): which
// grad_value path, which dots kernel and which vector widths serve a problem
// on CUDA, and whether the fused operator falls back to its ATen composite.
// A pure function of the problem, the device (DeviceInfo) and the caller's
// wishes; the CUDA launchers (cuda/msda_cuda.cpp, cuda/backward/) take its
// plan and test nothing else, and ms_deform_attn.select_backward_plan shows
// it (both through plan_backward_for, backend_queries.h). docs/backward.md
// explains each path and why it wins where it is chosen.
#pragma once

#include <cstdint>
#include <string>

#include "../core/params.h"
#include "device.h"

namespace msda {

// What the caller asked for: a grad_value path (the environment's
// MS_DEFORM_ATTN_GRAD_VALUE, read in overrides.cpp, or the query's argument).
// atomic: atomics unless the call is deterministic; sorted: the global sort
// even where the block-local path applies; local: a reproducible path, the
// block-local one where it applies.
enum class GradValueRequest : int { automatic, atomic, sorted, local };
GradValueRequest parse_grad_value_request(const std::string& name);  // throws on unknown names

struct BackwardProblem {
  Problem pb;
  bool fused = false;      // ms_deform_attn_fused's backward
  int value_align = 16;    // bytes value's and grad_output's data pointers are aligned to
  int grad_out_align = 16; // (the largest power of two dividing the address, at most 32)
};

// The problem of validated inputs pb whose value's and grad_output's data
// are at `value` and `grad_out`.
inline BackwardProblem backward_problem(const Problem& pb, const void* value, const void* grad_out,
                                        bool fused) {
  BackwardProblem p;
  p.pb = pb;
  p.fused = fused;
  p.value_align = pointer_alignment(value);
  p.grad_out_align = pointer_alignment(grad_out);
  return p;
}

struct BackwardWishes {
  bool deterministic = false;
  GradValueRequest request = GradValueRequest::automatic;
  bool stage = true;  // the block-local walk may stage its inputs (BackwardPlan::stage)
  bool self_records = true;  // ... and make its records itself (BackwardPlan::self_records)
};

// The plan for p on device d given the caller's wishes w.
BackwardPlan plan_backward(const BackwardProblem& p, const DeviceInfo& d, const BackwardWishes& w);

// The conditions the planner tests, for the launchers' own checks.
// Tensor-core dots: D a multiple of 32, at most 32 sample slots a row (each
// level's points padded to 4), value rows numbered in 32 bits, rows below
// 2^31, value and grad_output 16-byte aligned (16-bit values are the
// caller's to ensure).
bool mma_dots_ok(const BackwardProblem& p);
// The block-local grad_value: Lq P <= kLocalCap, 16-bit or fp32 values with
// D a multiple of 16 bytes, 16-byte aligned grad_output, its 32-bit index
// ranges, and the kernel's shared memory on the device.
bool local_grad_value_ok(const BackwardProblem& p, const DeviceInfo& d);
// Whether that path's walk stages its inputs (BackwardPlan::stage): Lq P <=
// kLocalCapSmall and local_stage_bytes <= kLocalStageMax, within the device's
// shared memory a block.
bool local_stage_ok(const BackwardProblem& p, const DeviceInfo& d);
// The names of the plan's choices, as the queries give them.
const char* grad_value_name(GradValuePath path);
const char* dots_name(DotsKernel dots);
const char* gather_name(GatherKernel gather);

}  // namespace msda
