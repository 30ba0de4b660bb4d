// The operator library's kernels as plain functions over torch's C tensor
// handles, for the version-bound layer: it registers them unboxed on the
// CPU, CUDA and CompositeExplicitAutograd keys (kernels.cpp), so that a call
// pays no boxing. A kernel registered through the stable ABI is boxed: each
// call converts every argument to an IValue and a stable handle and back.
// Where no layer is loaded (a torch release the build has none for), the
// library registers the same functions boxed instead
// (ms_deform_attn_register_boxed_kernels); never both.
//
// Shared by the library (csrc/binding/registration.cpp) and the layer: plain types
// only, no ATen and no stable Tensor.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

// The library is built with hidden visibility (as torch's stable headers
// declare their own types): these are the symbols it exports.
#define MSDA_LIBRARY_API __attribute__((visibility("default")))

namespace msda::library {

enum class Kernel : int {
  forward_cpu,
  backward_cpu,
  column_sum_cpu,
  forward_cuda,
  backward_cuda,
  column_sum_cuda,
  fused_forward_cuda,
  fused_backward_cuda,
  fused_forward_composite,
  fused_backward_composite,
  fused_backward_ref_composite,
  linear_composite,
  count,  // the number of kernels; keep last
};

// One call of a kernel: its arguments in schema order, tensors apart.
struct Call {
  // The tensor arguments: new handles, which the kernel takes over (it
  // deletes them, also when it raises).
  AtenTensorHandle* in = nullptr;
  size_t in_count = 0;
  // Receives the results, borrowed: the caller copies the tensors it keeps
  // (a copy is a reference count, not a new handle). Called once, with the
  // results in schema order, unless the kernel raises.
  void (*take_results)(void* context, const AtenTensorHandle* results) = nullptr;
  void* context = nullptr;
  std::string_view backend = "auto";
  int deterministic = -1;  // -1: None
  const int64_t* shapes_list = nullptr;
  int64_t shapes_list_len = -1;  // -1: None
};

// Whether this build has kernel k (the CUDA ones need a CUDA build).
MSDA_LIBRARY_API bool has_kernel(Kernel k);

// Runs kernel k; raises what its registered kernel would (std::runtime_error).
MSDA_LIBRARY_API void run_kernel(Kernel k, Call& call);

}  // namespace msda::library

// Registers every kernel through the stable ABI (boxed), for a process
// without the layer; once, whatever the number of calls.
extern "C" MSDA_LIBRARY_API void ms_deform_attn_register_boxed_kernels(void);

// The library's version (ms_deform_attn/version.h): _C.library_version.
extern "C" MSDA_LIBRARY_API const char* ms_deform_attn_library_version(void);
