// The deterministic backward's grad_value (deterministic.cpp), for the
// operator in msda_cuda.cpp.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include "../params.h"
#include "../validation.h"

namespace msda::cuda {

// grad_value by sort and gather: bitwise the same on every run. p is the
// backward's params with everything but grad_value set. Where the samples of
// one (n, m, level) fit a block (local_value_grad_ok) the block-local kernel
// (backward_local.cu) serves it with a 20-byte record a sample, else the
// global sort (backward_deterministic.cu).
at::Tensor deterministic_grad_value(BackwardParams p, const Prepared& in, cudaStream_t stream);

// The grad_value path the environment asks for, MS_DEFORM_ATTN_GRAD_VALUE
// (for tests and benchmarks; read on every call): "atomic" (the atomics,
// unless the call is deterministic), "sorted" (the global sort), "local" (the
// block-local sort where it applies, else the global one); anything else:
// automatic (sorted_backward_preferred decides, local wherever it applies).
enum class GradValuePath { automatic, atomic, sorted, local };
GradValuePath grad_value_path();

// Whether the backward takes the sorted (deterministic) path for p.
bool use_sorted_backward(const BackwardParams& p, bool deterministic);

}  // namespace msda::cuda
