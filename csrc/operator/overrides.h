// The environment variables that override the library's own choices, for
// tests and benchmarks. They are read here and nowhere else, on every call
// (tests change them between calls); docs/development.md lists them.
#pragma once

#include <cstdint>
#include <string>

#include "../plan/backward_plan.h"
#include "../core/params.h"

namespace msda {

// MS_DEFORM_ATTN_BACKEND: the forward backend "auto" resolves to ("" unset or "auto").
std::string backend_override();
// MS_DEFORM_ATTN_GRAD_VALUE: auto, atomic, sorted or local (backward_plan.h).
GradValueRequest grad_value_override();
// MS_DEFORM_ATTN_BLOCKED_ROWS: how `blocked` sets up a row's samples: auto,
// shared (once a sample, handed over through shared memory) or lane (on
// every lane of the row); see BlockedRows.
BlockedRows blocked_rows_override();
// MS_DEFORM_ATTN_LOCAL_STAGE=0: the block-local walk loads its inputs from
// global memory where it would stage them (BackwardPlan::stage; the same bits).
bool local_stage_override();
// MS_DEFORM_ATTN_LOCAL_SELF=0: the staged block-local walk reads the dots
// kernel's records instead of making its own (BackwardPlan::self_records).
bool local_self_override();
// MS_DEFORM_ATTN_SMEM_BUDGET: shared-memory bytes the caching forward backends may use (-1: theirs).
int64_t smem_budget_override();
// MS_DEFORM_ATTN_POISON=1: outputs are filled with NaN before the kernels
// write them, so that an element left unwritten fails a comparison (read once).
bool poison_outputs();
// MS_DEFORM_ATTN_CHECK_SHAPES=1: CUDA level shapes are read back and checked
// on the host (a synchronisation) instead of only in the kernels.
bool check_shapes_on_host();

}  // namespace msda
