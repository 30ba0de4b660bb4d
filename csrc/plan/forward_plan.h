// The forward's policy, in one place: which backends exist, which of them a
// device and a problem allow (each backend's can-run checks), the one `auto`
// picks, and how the chosen kernel is launched (block shape, lane split,
// shared-memory budget, vector width, whether value is copied, whether the
// fused operator takes its ATen composite). A pure function of the problem,
// a DeviceInfo and the caller's wishes; the CUDA launchers take its plan
// (ForwardPlan, params.h) and test nothing else, and
// ms_deform_attn.select_forward_plan shows it (both through
// plan_forward_for, backend_queries.h). docs/backends.md explains each
// backend and why auto picks what it picks.
#pragma once


#include <string>
#include <string_view>
#include <vector>

#include "../core/params.h"
#include "device.h"

namespace msda {

// Where a backend runs: on CPU tensors, on CUDA tensors, or from the Python
// entry points only (`pytorch`).
enum class Runs { cpu, cuda, python };

// Every backend name of the library, whatever the build, one row of the
// backend table each: "cpu", the CUDA backends in the order "auto" prefers
// them, and "pytorch" (the operator in plain PyTorch ops, run by the Python
// entry points only; never picked by "auto").
const std::vector<std::string>& backend_names();
// Raises unless `backend` is "auto" or one of backend_names().
void check_backend_name(std::string_view backend);
const char* backend_name(ForwardBackend b);

struct ForwardProblem {
  Problem pb;
  bool fused = false;     // ms_deform_attn_fused (offsets and logits in; ForwardParams::ref)
  int value_align = 32;   // value's data pointer alignment in bytes (pointer_alignment, at most 32)
};

// The problem of validated inputs pb whose value's data is at `value`.
inline ForwardProblem forward_problem(const Problem& pb, const void* value, bool fused) {
  ForwardProblem p;
  p.pb = pb;
  p.fused = fused;
  p.value_align = pointer_alignment(value);
  return p;
}

struct ForwardWishes {
  std::string backend = "auto";  // "auto" or a name of backend_names()
  // Test hooks (MS_DEFORM_ATTN_BLOCKED_ROWS, MS_DEFORM_ATTN_SMEM_BUDGET, read in overrides.cpp).
  BlockedRows blocked_rows = BlockedRows::automatic;
  int64_t smem_budget = -1;      // cache bytes of a caching backend (-1: its default)
};

// The backends that run on `where` (for CUDA, those device *d can run at
// all), in the order "auto" prefers them.
std::vector<std::string> backends_on(Runs where, const DeviceInfo* d);
// Why "pytorch" cannot run in the C++ operator, on any device.
std::string reference_backend_reason();
// Why backend `name` cannot run problem p on tensors of `on` (cpu or cuda;
// d: the CUDA device's figures) ("" when it can): "auto" always can; an
// unknown name, a backend of the other device and "pytorch" say why not.
std::string backend_reason_on(const std::string& name, const ForwardProblem& p, Runs on,
                              const DeviceInfo* d);
// The backend "auto" resolves to for p on d.
std::string auto_backend(const ForwardProblem& p, const DeviceInfo& d);

// The plan for p on CUDA device d given the wishes w; raises, naming the
// reason, when the backend asked for cannot run p there.
ForwardPlan plan_forward(const ForwardProblem& p, const DeviceInfo& d, const ForwardWishes& w);



}  // namespace msda
