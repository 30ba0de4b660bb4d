// The CUDA backend table: each forward backend's predicates, its place in
// the order "auto" prefers, its workspace and alignment needs. The operator
// (msda_cuda.cpp) looks backends up here; the device-agnostic queries
// (../backends.h) are answered from here too.
#pragma once

#include <c10/util/string_view.h>
#include <cuda_runtime.h>

#include <string>

#include "../../params.h"

namespace msda::cuda {

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
  // Forms ms_deform_attn_fused's locations and softmax itself (ForwardParams::ref);
  // the fused operator takes its composite on the others.
  bool fused_points = false;
};

// "auto" resolved (the environment variable MS_DEFORM_ATTN_BACKEND, when set
// to a name, overrides it), then looked up; raises with the predicate's
// reason when that backend cannot run pb on `device`.
const CudaBackend& backend_for(c10::string_view name, const Problem& pb, int device);

}  // namespace msda::cuda
